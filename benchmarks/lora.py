"""Rank memory of LoRA against full fine-tuning of the same model, in the same run (issue 35, item 3).

One ``LlamaForCausalLM`` built from a config (default: 8 layers, hidden 512, vocab 8192: about
35.7M parameters, 136 MiB in fp32) is fine-tuned for a few Adam steps with the body
``loss = model(input_ids=x, labels=x).loss`` on 2 CPU ranks, under ddp and fsdp, two ways:

- **full**: every parameter trains (gradients and Adam's two moments for all of them);
- **lora**: ``peft.get_peft_model(model, LoraConfig(r=8, target_modules=q,k,v,o))``: the base is
  frozen, only the adapters train (gradients and optimizer state for them only).

Each case runs in a fresh 2-rank cluster (``distnb.start(n=2)``, stopped after), so no case
inherits another's heap; the cases alternate round by round (the order flips). Figures per case,
medians over the rounds: the largest rank's peak resident set during the training cell
(``TrainResult.rows[i]["peak_memory"]``, reset at the cell's start), the trainable parameters, and
under fsdp the optimizer state each rank holds (``optimizer_state_bytes``).

Usage::

    .venv/bin/python benchmarks/lora.py [--rounds 2] [--layers 8] [--hidden 512] [--steps 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# benchmarks/transformers.py would shadow Hugging Face's transformers (this folder is sys.path[0])
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

import torch  # noqa: E402

BODY = "x, = batch\nloss = model(input_ids=x, labels=x).loss"
MIB = 2 ** 20


def build(args, lora: bool):
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=args.seq)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


def run_case(args, strategy: str, lora: bool) -> dict:
    import distnb

    ns = {"net": build(args, lora)}
    g = torch.Generator().manual_seed(1)
    ns["data"] = torch.utils.data.TensorDataset(torch.randint(0, args.vocab, (2 * args.batch * args.steps, args.seq),
                                                              generator=g))
    session = distnb.start(n=2, ns=ns, quiet=True)
    try:
        t0 = time.perf_counter()
        result = session.train(BODY, model="net", data="data", epochs=1, batch_size=args.batch, optimizer="adam",
                               lr=1e-4, strategy=strategy, progress="none", quiet=True)
        seconds = time.perf_counter() - t0
    finally:
        session.stop(quiet=True)
    return dict(strategy=strategy, mode="lora" if lora else "full", seconds=seconds,
                peak=max(r["peak_memory"] for r in result.rows),
                optimizer_state=max(r.get("optimizer_state_bytes") or 0 for r in result.rows),
                trainable=result.num_trainable_params, total=result.num_params, loss=result.final_loss)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cases = [(s, lora) for s in args.strategies.split(",") for lora in (False, True)]
    runs: dict[tuple, list] = {c: [] for c in cases}
    for r in range(args.rounds):
        for strategy, lora in (cases if r % 2 == 0 else cases[::-1]):
            runs[(strategy, lora)].append(run_case(args, strategy, lora))
    print("| strategy | fine-tuning | trainable / total parameters | rank peak RSS, MiB | rank optimizer state, MiB "
          "| LoRA / full peak |")
    print("|---|---|---|---|---|---|")
    rows = []
    for strategy, lora in cases:
        got = runs[(strategy, lora)]
        peak = statistics.median(x["peak"] for x in got)
        full = statistics.median(x["peak"] for x in runs[(strategy, False)])
        state = statistics.median(x["optimizer_state"] for x in got)
        first = got[0]
        ratio = f"{peak / full:.2f}" if lora else ""
        print(f"| {strategy} | {first['mode']} | {first['trainable']:,} / {first['total']:,} | {peak / MIB:.0f} | "
              f"{state / MIB:.1f} | {ratio} |" if strategy == "fsdp" else
              f"| {strategy} | {first['mode']} | {first['trainable']:,} / {first['total']:,} | {peak / MIB:.0f} | "
              f"(not reported for ddp) | {ratio} |")
        rows.append(dict(strategy=strategy, lora=lora, runs=got))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
