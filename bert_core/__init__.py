"""bert_core: BERT pre-training and fine-tuning, one module per pipeline step.

The library has no orchestration imports: KFP components and DVC stages call the `bert` CLI
(`bert_core.cli`), which dispatches to one module per step.
"""

__version__ = "0.1.0"
