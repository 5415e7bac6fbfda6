"""Does vLLM for CPU scale `prompt_embeds` by a Gemma model's sqrt(hidden_size)? Measured on tiny seeded random
Gemma checkpoints: vLLM from token ids vs vLLM from transformers' `get_input_embeddings()(ids)` and from those rows
divided by the scale. Needs the vLLM venv (see bench/vllm_check.py):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/_vllm_gemma.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import transformers

from peft_softprompt_plus.apps.tiny import tiny_tokenizer

NEW_TOKENS = 8
PROMPT_LENGTHS = (6, 8, 10, 12)
# Large enough init that the layers' outputs are comparable with the residual stream: with the default 0.02 the
# embeddings dominate it, and the final RMSNorm would hide any scale put on them. Gemma 2/3's post-norms (zero
# weights, gain 1) otherwise keep each layer's output far below the sqrt(hidden)-scaled embedding, and with tied
# weights greedy then repeats the last token; random norm gains make the continuations vary.
INIT = 0.3
NORM_INIT = 4.0
_SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM CPU attention takes 32, 64, 80, ...; 16 fails "Unsupported CPU attention configuration"
    max_position_embeddings=512,
    initializer_range=INIT,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=1,
    attn_implementation="eager",  # gemma2's soft-capping needs it; the others take it too
)
GEMMAS: dict[str, tuple[str, dict]] = {  # family -> (config class in transformers, its arguments)
    "gemma": ("GemmaConfig", _SMALL),
    "gemma2": ("Gemma2Config", dict(_SMALL, sliding_window=8)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(_SMALL, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    ),
}


def build(family: str, out_dir: str, seed: int = 0):
    """A seeded random causal LM of `family` saved with the tiny tokenizer under `out_dir/family`; (model, path)."""
    if family not in GEMMAS:
        raise ValueError(f"`family` must be one of {sorted(GEMMAS)}, got {family!r}.")
    tokenizer = tiny_tokenizer()
    config_name, kwargs = GEMMAS[family]
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer), **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            if "RMSNorm" in type(module).__name__:
                module.weight.normal_(0, NORM_INIT)
    path = os.path.join(out_dir, family)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, path


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random ids past the two special tokens, one prompt per length in `PROMPT_LENGTHS`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def scale_placement(model) -> dict:
    """Where transformers puts the sqrt(hidden_size) factor: measured as embedding output / raw weight rows."""
    embedding = model.get_input_embeddings()
    ids = torch.arange(2, 10)
    with torch.no_grad():
        ratio = (embedding(ids) / embedding.weight[ids]).mean().item()  # [8, D] / [8, D]
    return {
        "module": type(embedding).__name__,
        "embed_scale_attr": float(embedding.embed_scale) if hasattr(embedding, "embed_scale") else None,
        "measured_ratio": round(ratio, 5),
        "sqrt_hidden": round(model.config.hidden_size**0.5, 5),
    }


def hf_greedy(model, embeds: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """A manual greedy loop from `[L, D]` embeddings, no EOS stop (random weights emit it anywhere); (tokens,
    `[NEW_TOKENS, V]` logprobs)."""
    tokens, logprobs = [], []
    embedding = model.get_input_embeddings()
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(inputs_embeds=embeds[None]).logits[0, -1]  # [V]
            logprobs.append(torch.log_softmax(logits.float(), -1))
            tokens.append(int(logits.argmax()))
            embeds = torch.cat([embeds, embedding(torch.tensor([tokens[-1]]))])  # [L+1, D]
    return tokens, torch.stack(logprobs)


def vllm_runs(path: str, requests: dict[str, list], vocab_size: int) -> dict[str, list]:
    """vLLM's greedy (tokens, `[NEW_TOKENS, V]` logprobs) per prompt for each named list of requests."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=path,
        enable_prompt_embeds=True,
        dtype="float32",
        max_model_len=512,
        max_logprobs=-1,
        seed=0,
        enforce_eager=True,  # the model code is the same compiled or not; skipping compilation saves minutes
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=-1)
    got = {}
    for name, rows in requests.items():
        outputs = llm.generate(rows, params, use_tqdm=False)
        got[name] = [(list(o.outputs[0].token_ids), _dense(o.outputs[0].logprobs, vocab_size)) for o in outputs]
    del llm
    return got


def _dense(steps: list[dict], vocab_size: int) -> torch.Tensor:
    """vLLM's per-step {token: Logprob} dicts as a `[steps, V]` tensor (NaN where a token is missing)."""
    out = torch.full((len(steps), vocab_size), float("nan"))
    for i, step in enumerate(steps):
        for token, logprob in step.items():
            if token < vocab_size:
                out[i, token] = logprob.logprob
    return out


def compare(runs: list, reference: list) -> dict:
    """Token-for-token agreement and the max |logprob difference| over the steps both runs share a context for."""
    same, worst = 0, 0.0
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(runs, reference, strict=True):
        same += tokens == ref_tokens
        shared = (
            next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), len(tokens) - 1) + 1
        )
        worst = max(worst, (logprobs[:shared] - ref_logprobs[:shared]).abs().nan_to_num(float("inf")).max().item())
    return {"rows_equal": f"{same}/{len(runs)}", "tokens_equal": same == len(runs), "max_abs_logprob_diff": worst}


def check_family(family: str, out_dir: str) -> dict:
    model, path = build(family, out_dir)
    vocab_size = model.config.vocab_size
    ids = prompts(vocab_size)
    scale = model.config.hidden_size**0.5
    with torch.no_grad():
        embeds = [model.get_input_embeddings()(torch.tensor(row)) for row in ids]  # each [L, D]
    hf = [hf_greedy(model, e) for e in embeds]
    hf_unscaled = [hf_greedy(model, e / scale) for e in embeds]
    requests = {
        "a_ids": [{"prompt_token_ids": row} for row in ids],
        "b_embeds_as_hf": [{"prompt_embeds": e} for e in embeds],
        "c_embeds_div_sqrt_hidden": [{"prompt_embeds": e / scale} for e in embeds],
    }
    got = vllm_runs(path, requests, vocab_size)
    return {
        "hf_embedding_scale": scale_placement(model),
        "hf_greedy_row0": " ".join(map(str, hf[0][0])),
        "vllm_ids_greedy_row0": " ".join(map(str, got["a_ids"][0][0])),
        "distinct_tokens_per_hf_row": [len(set(tokens)) for tokens, _ in hf],
        # how much (b) vs (c) can differ at all on this model: transformers fed E and E / sqrt(hidden)
        "hf_sensitivity_E_vs_E_div_scale": compare(hf_unscaled, hf),
        "a_ids_vs_hf": compare(got["a_ids"], hf),
        "b_vs_a": compare(got["b_embeds_as_hf"], got["a_ids"]),
        "c_vs_a": compare(got["c_embeds_div_sqrt_hidden"], got["a_ids"]),
    }


def check(out_dir: str) -> dict:
    """Per Gemma family: which of (b) E = transformers' embeddings and (c) E / sqrt(hidden) vLLM treats like ids."""
    import vllm

    result = {"vllm": vllm.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    for family in GEMMAS:
        try:
            result[family] = check_family(family, out_dir)
        except Exception as error:  # one family vLLM CPU cannot run should not hide the others' answers
            result[family] = {"error": f"{type(error).__name__}: {error}"}
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the tiny checkpoints (a temp folder by default)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(check(args.out or tmp), indent=1))
