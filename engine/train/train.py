"""Train the bundled Llama-architecture FIM code model (CPU or CUDA).

A wall-clock budget (``--max-minutes``) drives the cosine learning-rate schedule: the
schedule's progress is the fraction of the budget spent, so the rate anneals to its floor
exactly at the deadline however fast the (shared, niced) CPU happens to be.  Without a
budget, ``--max-steps`` drives it.  Checkpoints hold model, optimizer, step, consumed
sequences and elapsed training time; re-running the same command resumes.

    python -m engine.train.train --run-dir runs/spark-code-mini --max-minutes 90
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from .data import EditConfig, FimConfig, packed_sequences, shuffle_buffer
from .tokenizer import EOS, PAD, read_file_list

#: The arguments that fix a model's shape: a fine-tune (--init-from) and a resumed run keep them.
MODEL_SHAPE_ARGS = ("hidden", "layers", "heads", "kv_heads", "ffn", "context")


def build_config(args, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
    )


def lr_at(progress: float, step: int, args) -> float:
    """Linear warmup (by step), then cosine from ``lr`` to ``lr * min_lr_ratio`` over progress."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * p))


def save_checkpoint(path: Path, state: dict) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def plot_history(run_dir: Path, history: list[dict]) -> None:
    """Loss curve (train and validation loss against tokens seen) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [h for h in history if h["kind"] == "train"]
    va = [h for h in history if h["kind"] == "val"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if tr:
        ax.plot([h["tokens"] / 1e6 for h in tr], [h["loss"] for h in tr], lw=0.8, label="train")
    if va:
        ax.plot(
            [h["tokens"] / 1e6 for h in va],
            [h["loss"] for h in va],
            "o-",
            label="validation (held-out files)",
        )
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(f"{run_dir.name}: training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss_curve.png")
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Train the bundled FIM code model (Llama architecture)."
    )
    ap.add_argument(
        "--run-dir",
        type=Path,
        required=True,
        help="holds tokenizer.json + train/val_files.txt (from engine.train.tokenizer); checkpoints go here",
    )
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--context", type=int, default=2048, help="max_position_embeddings")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per forward pass")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="wall-clock training budget (drives the LR schedule)",
    )
    ap.add_argument("--max-steps", type=int, default=None, help="step budget when no --max-minutes")
    ap.add_argument("--fim-rate", type=float, default=0.5)
    ap.add_argument("--spm-rate", type=float, default=0.5)
    ap.add_argument(
        "--edit-rate",
        type=float,
        default=0.0,
        help="edited-copy documents per file, on average (engine.train.data.EditConfig)",
    )
    ap.add_argument(
        "--copy-rate",
        type=float,
        default=0.0,
        help="repeated shuffled-window documents per file, on average (engine.train.data.copy_document)",
    )
    ap.add_argument("--segment-chars", type=int, default=3000)
    ap.add_argument(
        "--shuffle-buffer", type=int, default=512, help="sequences mixed across files (1 = off)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="autocast dtype")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--log-every", type=int, default=5, help="steps")
    ap.add_argument("--val-every", type=float, default=10.0, help="minutes")
    ap.add_argument("--val-seqs", type=int, default=16)
    ap.add_argument("--ckpt-every", type=float, default=5.0, help="minutes")
    ap.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start a new phase from another run's checkpoint (warm restart): its weights, "
        "optimizer moments and loss history carry over; schedule, step and data order start afresh",
    )
    ap.add_argument(
        "--bench-steps",
        type=int,
        default=0,
        help="only time this many steps (after 2 warm-up steps), print tokens/s and exit",
    )
    args = ap.parse_args(argv)
    if args.max_minutes is None and args.max_steps is None and not args.bench_steps:
        ap.error("give --max-minutes or --max-steps")
    if args.batch_size % args.micro_batch:
        ap.error("--batch-size must be a multiple of --micro-batch")
    if args.seq_len > args.context:
        ap.error("--seq-len must not exceed --context")
    return args


def main(argv=None) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    args = parse_args(argv)
    run = args.run_dir
    tok_path = run / "tokenizer.json"
    if not tok_path.is_file():
        sys.exit(
            f"error: {tok_path} missing: run `python -m engine.train.tokenizer --out {run}` first"
        )
    tok = Tokenizer.from_file(str(tok_path))
    train_files = read_file_list(run / "train_files.txt")
    val_files = read_file_list(run / "val_files.txt")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ckpt_path = run / "ckpt.pt"
    ckpt = (
        torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ckpt_path.exists() and not args.bench_steps
        else None
    )
    init = None
    if ckpt is None and args.init_from is not None:
        init = torch.load(args.init_from, map_location="cpu", weights_only=False)
        for k in MODEL_SHAPE_ARGS:  # the shape is the parent's
            setattr(args, k, init["args"][k])
        args.tokens_before = init["seqs"] * init["args"]["seq_len"] + init["args"].get(
            "tokens_before", 0
        )
    if ckpt:  # the model shape and data stream of a run are fixed by its first invocation
        for k in (
            *MODEL_SHAPE_ARGS,
            "seq_len",
            "seed",
            "fim_rate",
            "spm_rate",
            "segment_chars",
            "shuffle_buffer",
            "tokens_before",
            "edit_rate",
            "copy_rate",
        ):
            if k in ckpt["args"]:
                setattr(args, k, ckpt["args"][k])
    tokens_before = getattr(args, "tokens_before", 0) or 0

    config = build_config(args, tok.get_vocab_size(), tok.token_to_id(EOS), tok.token_to_id(PAD))
    model = LlamaForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    step, seqs_done, elapsed, history = 0, 0, 0.0, []
    if ckpt:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        step, seqs_done, elapsed, history = (
            ckpt["step"],
            ckpt["seqs"],
            ckpt["elapsed"],
            ckpt["history"],
        )
        print(
            f"resumed at step {step}, {seqs_done * args.seq_len / 1e6:.2f}M tokens, {elapsed / 60:.1f} min",
            flush=True,
        )
    elif init:
        model.load_state_dict(init["model"])
        opt.load_state_dict(init["optimizer"])
        history = list(init["history"])
        print(
            f"new phase from {args.init_from}: {tokens_before / 1e6:.2f}M tokens already trained",
            flush=True,
        )

    fim = FimConfig(rate=args.fim_rate, spm_rate=args.spm_rate)
    edit = EditConfig(rate=args.edit_rate, copy_rate=args.copy_rate)
    stream = shuffle_buffer(
        packed_sequences(
            train_files, tok, args.seq_len, args.seed, fim, args.segment_chars, edit=edit
        ),
        args.shuffle_buffer,
        args.seed,
    )
    stream = itertools.islice(stream, seqs_done, None)
    val_batch = torch.tensor(
        list(
            itertools.islice(
                packed_sequences(val_files, tok, args.seq_len, 1, fim, args.segment_chars),
                args.val_seqs,
            )
        )
    )  # fixed: phases compare
    amp_dtype = torch.bfloat16 if args.precision == "bf16" else None

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(
            device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None
        ):
            return model(input_ids=batch, labels=batch).loss

    @torch.no_grad()
    def validate() -> float:
        model.eval()
        losses = [
            loss_of(val_batch[i : i + args.micro_batch].to(device)).item()
            for i in range(0, len(val_batch), args.micro_batch)
        ]
        model.train()
        return sum(losses) / len(losses)

    def checkpoint() -> None:
        save_checkpoint(
            ckpt_path,
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "seqs": seqs_done,
                "elapsed": elapsed,
                "history": history,
                "args": vars(args) | {"run_dir": str(run)},
                "config": config.to_dict(),
            },
        )
        plot_history(run, history)

    budget_s = args.max_minutes * 60 if args.max_minutes else None
    print(
        f"model: {n_params / 1e6:.2f}M params ({args.layers}x{args.hidden}, ffn {args.ffn}, "
        f"vocab {config.vocab_size}); device {device}, {args.precision}, seq {args.seq_len}, "
        f"batch {args.batch_size}; budget {args.max_minutes} min / {args.max_steps} steps",
        flush=True,
    )
    model.train()
    accum = args.batch_size // args.micro_batch
    t_last_val = t_last_ckpt = time.monotonic()
    t_log, tok_log, loss_log = time.monotonic(), 0, []
    bench_t0 = None
    stop = []  # SIGTERM/SIGINT: finish the step, validate, checkpoint, exit cleanly
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    while not stop:
        progress = elapsed / budget_s if budget_s else step / max(args.max_steps or 1, 1)
        if args.bench_steps and step >= args.bench_steps + 2:
            dt = time.monotonic() - bench_t0
            print(
                f"bench: {args.bench_steps * args.batch_size * args.seq_len / dt:.0f} tokens/s "
                f"({args.precision}, {args.threads} threads)",
                flush=True,
            )
            return
        if not args.bench_steps and progress >= 1.0:
            break
        t0 = time.monotonic()
        if step == 2:
            bench_t0 = t0
        lr = lr_at(progress, step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        total = 0.0
        for _ in range(accum):
            batch = torch.tensor([next(stream) for _ in range(args.micro_batch)], device=device)
            loss = loss_of(batch) / accum
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        seqs_done += args.batch_size
        elapsed += time.monotonic() - t0
        tok_log += args.batch_size * args.seq_len
        loss_log.append(total)
        tokens = tokens_before + seqs_done * args.seq_len
        if step % args.log_every == 0:
            dt = time.monotonic() - t_log
            avg = sum(loss_log) / len(loss_log)
            history.append(
                {
                    "kind": "train",
                    "step": step,
                    "tokens": tokens,
                    "loss": avg,
                    "lr": lr,
                    "elapsed": elapsed,
                }
            )
            bar = "#" * int(20 * min(progress, 1)) + "." * (20 - int(20 * min(progress, 1)))
            print(
                f"[{bar}] step {step} loss {avg:.4f} lr {lr:.2e} tok/s {tok_log / dt:.0f} "
                f"tokens {tokens / 1e6:.2f}M elapsed {elapsed / 60:.1f}m",
                flush=True,
            )
            t_log, tok_log, loss_log = time.monotonic(), 0, []
        now = time.monotonic()
        if not args.bench_steps and now - t_last_val >= args.val_every * 60:
            v = validate()
            history.append(
                {"kind": "val", "step": step, "tokens": tokens, "loss": v, "elapsed": elapsed}
            )
            print(f"validation loss {v:.4f} at step {step}", flush=True)
            t_last_val = time.monotonic()
        if not args.bench_steps and now - t_last_ckpt >= args.ckpt_every * 60:
            checkpoint()
            t_last_ckpt = time.monotonic()
    v = validate()
    history.append(
        {
            "kind": "val",
            "step": step,
            "tokens": tokens_before + seqs_done * args.seq_len,
            "loss": v,
            "elapsed": elapsed,
        }
    )
    checkpoint()
    summary = {
        "step": step,
        "tokens": tokens_before + seqs_done * args.seq_len,
        "phase_tokens": seqs_done * args.seq_len,
        "elapsed_min": round(elapsed / 60, 2),
        "final_val_loss": v,
        "params": n_params,
    }
    (run / "train_summary.json").write_text(json.dumps(summary, indent=1))
    print("done:", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
