"""The data steps: raw text -> clean documents -> WordPiece vocabulary -> MLM/NSP instances.

Owns `bert clean` (`corpus`, with the text rules in `documents` and the junk detector in
`text_quality`), `bert vocab` (`tokenizer`: WordPiece training and the tokenizer every later step
loads) and `bert instances` (`instances`, its settings in `instance_config`, one shard's work in
`instance_shards`, the original algorithm in `instance_sampling`, the 80/10/10 rule in
`masking`), with `workers` the process pool both fan out over. Everything here is CPU work
on files, byte-reproducible from its seeds.

May import: `bert_core.model` (a preset's max positions bound `--max-seq-length`), `storage`,
`tracking`, `options`, `errors`. Nothing above (pretrain, finetune, serve, ...).
"""
