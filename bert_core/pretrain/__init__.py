"""Pre-training: `bert pretrain`, masked LM + next sentence prediction with Ray Train.

Owns the command (`command`: checks, the Ray run, the exported model), its settings (`config`),
the instance shards (`shards`), batches and dynamic masking (`data`), the per-worker training
loop (`worker`), what rank 0 and the driver tell each other during a run (`channel`), checkpoints
and resumable state (`state`), the held-out MLM/NSP evaluation (`heldout`) and the submission to
a RayCluster through the Ray Jobs API (`ray_jobs`).

May import: `bert_core.data`, `bert_core.model`, `storage`, `tracking`, `options`, `errors`.
Not `finetune` (a sibling) nor anything above.
"""
