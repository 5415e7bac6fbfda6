"""`softprompt-plus distill`: fetch or open the checkpoint, distill the system prompt, save the adapter."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer

from ..distill.run import distill_prompt
from .fetch import CHECKPOINTS, fetch_checkpoint


def main(args, system_prompt: str, user_turns, held_out_turns, probes=None) -> int:
    """`softprompt-plus distill` once its arguments are checked (cli.py): distill, print, save."""
    path = fetch_checkpoint(args.model) if args.model in CHECKPOINTS else args.model
    print(f"distilling {args.system_prompt_file} into {args.num_virtual_tokens} soft tokens of {path}", flush=True)
    model = distill_prompt(
        AutoModelForCausalLM.from_pretrained(path),
        AutoTokenizer.from_pretrained(path),
        system_prompt,
        num_virtual_tokens=args.num_virtual_tokens,
        steps=args.steps,
        user_turns=user_turns,
        held_out_turns=held_out_turns,
        probes=probes,
        turns_per_part=args.turns_per_part,
        answer_weight=args.answer_weight,
        greedy_part_replies=args.greedy_part_replies,
        quote_parts=args.quote_parts,
        keep_text=args.keep_text,
        in_system_turn=args.in_system_turn,
        chat=not args.plain,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        prompt_level=args.prompt_level,
        prompt_init=args.prompt_init,
        self_study=args.self_study,
        kl_top_k=args.kl_top_k,
        kv_frozen_positions=args.kv_frozen_positions,
        progress=lambda line: print(line, flush=True),
    )
    model.save_pretrained(args.out)
    chat = ", chat=False" if args.plain else ""
    print(
        f"adapter saved to {args.out}: load it with PeftModel.from_pretrained(base, {args.out!r}); format its "
        f"inputs with peft_softprompt_plus.student_inputs(tokenizer, conversations{chat})"
    )
    return 0
