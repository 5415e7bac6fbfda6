"""Applications built on the library, outside the core (nothing in the method imports them, and
`import peft_softprompt_plus` does not load them): the command line, the demo, the capitals task, the checkpoint
fetcher, the tiny model zoo used by tests and examples."""
