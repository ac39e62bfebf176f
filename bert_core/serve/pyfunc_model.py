"""The MLflow model's code, logged as "model from code" (`serving.log_model`).

MLflow runs this file when it loads the model, instead of unpickling a Python object: a model
file then holds no pickle, which would run arbitrary code on load. The class lives in
`bert_core.serve.mlflow_model`, which the model carries (`code_paths`).
"""

from mlflow.models import set_model

from bert_core.serve.mlflow_model import BertPyfunc

set_model(BertPyfunc())
