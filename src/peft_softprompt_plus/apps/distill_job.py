"""`softprompt-plus distill`: distill the system prompt, save the adapter and its report."""

from __future__ import annotations

import os

from transformers import AutoModelForCausalLM, AutoTokenizer

from ..distill.options import from_cli
from ..distill.run import distill_prompt
from .fetch import CHECKPOINTS, fetch_checkpoint

REPORT_FILE = "distill_report.json"  # beside the adapter: `DistillReport.save`


def main(args, system_prompt: str, user_turns, held_out_turns, probes=None) -> int:
    """`softprompt-plus distill` once its arguments are checked (distill_args.py): distill with the options the flags
    name (`from_cli`), print, save."""
    path = fetch_checkpoint(args.model) if args.model in CHECKPOINTS else args.model
    n = args.num_virtual_tokens or "the default number of"
    print(f"distilling {args.system_prompt_file} into {n} soft tokens of {path}", flush=True)
    model = distill_prompt(
        AutoModelForCausalLM.from_pretrained(path),
        AutoTokenizer.from_pretrained(path),
        system_prompt,
        from_cli(args),
        user_turns=user_turns,
        held_out_turns=held_out_turns,
        probes=probes,
        progress=lambda line: print(line, flush=True),
    )
    model.save_pretrained(args.output_dir)
    model.distill_report.save(os.path.join(args.output_dir, REPORT_FILE))
    chat = ", chat=False" if args.plain else ""
    out = args.output_dir
    print(
        f"adapter saved to {out}: load it with PeftModel.from_pretrained(base, {out!r}); format its "
        f"inputs with peft_softprompt_plus.student_inputs(tokenizer, conversations{chat}); the options it ran with "
        f"and its figures in {os.path.join(args.output_dir, REPORT_FILE)}"
    )
    return 0
