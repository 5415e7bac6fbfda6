"""`softprompt-plus serve`: soft prompts by name in front of a running vLLM OpenAI server. A request goes
`app.py` (routes) -> `http_edges.py` (gate, body) -> `requests.py` (fields checked) -> `ops.py` (limits) ->
`front.py` (the adapter's record, its text and bodies; `embeds.py` builds `prompt_embeds`, `kv_fields.py` a KV
prompt's fields, `salts.py` its `cache_salt`) -> `upstream.py` (vLLM) -> `replies.py` (the answer).
Adapters: `fit.py` (made to fit the engine), `share.py` (KV share files), `compose.py` (compositions);
`health.py` answers `GET /health`. Imports nothing at package import: the CLI checks its arguments with
`requests.py` before torch loads."""
