"""The engine layer: one model's training, sampling and checkpoint requests, and what they share.

    pipeline    ForwardBackwardPipeline: ordered forward-backward / optim-step / sample requests
    futures     the ordered request queue it builds on, and the futures requests return
    client      AsyncTrainingClient: the reference docs' future-returning client over a pipeline
    state       checkpoints (format, atomic write, load), RNG state, discovery, retention, preemption
    dist        Accelerate / DeepSpeed / DDP plumbing; frozen-model placement
    generation  batched sampling with per-token log-probs (`generate`, `Rollout`)
    scoring     the per-step sampling distribution; no-grad log-probs of given tokens
    chunked     the LM head run chunk by chunk (no (B, T, V) logits)
    losses      token log-probs and the engine-signature losses (`LOSS_FNS`) over `rl.algos`
    packing     padding-free packed rows; left padding and position ids
    optim       AdamW and the learning-rate schedule
    tracking    metrics: progress bar, JSONL, accelerate's trackers, plot

Engine modules import `rl.config`, `rl.algos`, `rl.errors` and each other, never a higher layer
(`rl.models`, `rl.data`, `rl.trainers`, `rl.scripts`, ...).
"""
