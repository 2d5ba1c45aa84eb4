"""GPU-scale benchmark on a random-weight target shaped like a real preset (default Qwen2.5-7B-Instruct).

No weights are downloaded: the target is built from the preset's config (``conf/model/arch/*.json``)
with random weights, in the pipeline's dtype. Measures, with the pipeline's own code:
- extraction: hidden-state capture at the head's taps + the full-vocabulary argmax, tokens/s and peak
  memory, at ``extract.batch_tokens`` per forward;
- training: EAGLE-3 steps (training-time test at the preset's ``head.ttt_steps``, ``head.draft_vocab_size``,
  ``train.micro_batch_tokens``) through the DeepSpeed engine, tokens/s and peak memory (target freed).

    python scripts/bench_gpu_scale.py [--model qwen2.5-7b] [--row-len 2048] [--steps 6] [--layers N] [key=value ...]

``--layers`` shrinks the target's depth (CPU smoke runs); the head's shapes stay the preset's. Any
preset runs, the tiny ones included (``--model tiny-llama head.draft_vocab_size=64``: the CPU smoke test).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _bench import compose


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--row-len", type=int, default=2048, help="tokens per row (rows = micro_batch / row_len)")
    parser.add_argument("--steps", type=int, default=6, help="timed training steps (after 2 warm-up steps)")
    parser.add_argument("--layers", type=int, default=None, help="override the target's depth (smoke runs)")
    parser.add_argument("overrides", nargs="*", help="pipeline config overrides, e.g. head.ttt_steps=3")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    from heads.io import build_head, head_config
    from train import dist
    from train.extract import capture, capture_layers
    from train.loop import compute, deepspeed_config, param_groups
    from train.losses import full_argmax
    from train.plan import architecture
    from train.target import resolve_device, resolve_dtype

    cfg = compose([f"model={args.model}", *args.overrides])
    device = dist.bind_device(resolve_device(cfg.device))
    dtype = resolve_dtype(cfg.dtype, device)
    config = AutoConfig.for_model(**architecture(cfg).to_dict())
    if args.layers:
        config.num_hidden_layers = args.layers
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    params = sum(p.numel() for p in target.parameters())
    print(f"target {args.model}: {params / 1e9:.2f}B params, {config.num_hidden_layers} layers, vocab "
          f"{config.vocab_size}, {dtype}, built in {time.time() - t0:.0f} s on {device}", flush=True)

    layers = capture_layers(cfg, config)
    rows = max(1, cfg.train.micro_batch_tokens // args.row_len)
    vocab = config.vocab_size

    def batch(n_rows: int, length: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n_rows, length), device=device)

    # Extraction: the extract stage's capture + argmax, at extract.batch_tokens per forward.
    ex_rows = max(1, cfg.extract.batch_tokens // args.row_len)
    lm_head = target.get_output_embeddings().weight
    with torch.inference_mode():
        for _ in range(2):
            states = capture(target, batch(ex_rows, args.row_len), layers)
            full_argmax(states[:, :, -1], lm_head)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0, n = time.time(), 4
        for _ in range(n):
            states = capture(target, batch(ex_rows, args.row_len), layers)
            full_argmax(states[:, :, -1], lm_head)
        sync(device)
        ex_s = time.time() - t0
    extract = {"tokens_per_s": round(n * ex_rows * args.row_len / ex_s), "peak_gib": round(peak_gib(device), 2),
               "batch_tokens": ex_rows * args.row_len, "bytes_per_token": len(layers) * config.hidden_size * 2}
    print(f"extract: {extract}", flush=True)

    # Training inputs: real captures of the random target, kept on the device; then the target goes.
    with torch.no_grad():
        data = []
        for _ in range(3):
            ids = batch(rows, args.row_len)
            states = capture(target, ids, layers).clone()
            data.append({"input_ids": ids.clone(), "loss_mask": torch.ones_like(ids),
                         "lengths": torch.full((rows,), args.row_len, device=device), "states": states,
                         "argmax": full_argmax(states[:, :, -1], lm_head).clone(), "tokens": rows * args.row_len})
    dv = cfg.head.draft_vocab_size
    draft_rows = lm_head[:dv].detach().clone()
    embed = target.get_input_embeddings().weight.detach().clone()
    del target, lm_head, states
    torch.cuda.empty_cache() if device.type == "cuda" else None

    import deepspeed

    dist.init(device, single=True)
    head = build_head("eagle3", head_config("eagle3", config, cfg.head, dv))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:dv] = True
    head.set_vocab(torch.zeros(dv, dtype=torch.long), t2d)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(embed)
    del embed
    head.to(device)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(head, cfg.train.weight_decay), lr=cfg.train.lr, betas=(0.9, 0.95))
    engine, *_ = deepspeed.initialize(model=head, optimizer=optimizer, config=deepspeed_config(cfg.train, dtype))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(args.steps + 2):
        sync(device)
        t0 = time.time()
        stats = compute(engine.module, "eagle3", data[step % len(data)], draft_rows, cfg, cfg.train.positions,
                        cfg.head.ttt_steps)
        engine.backward(stats.loss)
        engine.step()
        sync(device)
        times.append(time.time() - t0)
    step_s = sorted(times[2:])[len(times[2:]) // 2]
    train = {"tokens_per_s": round(rows * args.row_len / step_s), "step_s": round(step_s, 3),
             "peak_gib": round(peak_gib(device), 2), "ttt_steps": cfg.head.ttt_steps, "draft_vocab": dv,
             "micro_batch_tokens": rows * args.row_len, "head_trainable_params_m": round(sum(p.numel() for p in trainable) / 1e6, 1),
             "optimizer": type(engine.optimizer).__name__, "loss": round(float(stats.loss.detach()), 3)}
    print(f"train: {train}", flush=True)
    print(json.dumps({"model": args.model, "device": str(device), "dtype": str(dtype), "extract": extract,
                      "train": train}))


if __name__ == "__main__":
    main()
