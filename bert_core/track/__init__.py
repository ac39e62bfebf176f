"""The pipeline's records across steps: lineage in MLflow and the runs table.

Owns `lineage` (a pipeline run's MLflow parent run for KFP and DVC, its child runs, the data
digests, the final state a Kubeflow exit handler reports, registering the pre-trained model) and
`runs` (`bert runs`: recent pipeline runs side by side). One step's own run is `tracking`'s, at
the bottom of the library; this package is near the top because it registers models (`serve`).

May import: `bert_core.serve`, `bert_core.report` and everything below them. Only the CLI
imports it.
"""
