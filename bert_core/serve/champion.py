"""`champion`: which version of a task's registered model is served, and why.

The first version of a task's model that beats the task's baseline becomes champion
when registered (its `bert.promotion` tag says "first champion"), so a model is servable from
its first sound run. After that only `bert promote TASK [VERSION]` moves it, to the version
(default: the `candidate`) whose dev score beats the current champion's (ties keep the champion;
`--force` moves it anyway), and records the decision as the version's `bert.promotion` tag, so
the registry shows why each champion is one. A version whose dev score does not beat its task's
baseline (`bert.baseline_score`: the best answer that ignores the input, on the same dev set,
e.g. SST-2's majority label) is registered but never champion, `--force` or not: a model that
learned nothing (a diverged or too short fine-tuning) must not be served. Serving and batch
inference then name the alias, never a number: `models:/bert-sst2@champion`.

This module is the rule and its record (the `bert.promotion` tag); `registry` registers
versions and tags them with the scores the rule reads, `bert promote` (`serve.promote`) and the
pipelines' promote gates apply it, `deploy` serves what it chose.
"""

from __future__ import annotations

import math

from bert_core.errors import BadValue, BertError, redacted
from bert_core.tracking import tracking_uri

CANDIDATE, CHAMPION = "candidate", "champion"
SCORE_TAG, PROMOTION_TAG = "bert.dev_score", "bert.promotion"
BASELINE_TAG = "bert.baseline_score"  # the task's input-blind answer's score on the same dev set
FIRST = "first champion (dev score {:.4g})"


def on_register(client, name: str, version: str, score: float, baseline: float) -> None:
    """A version just registered: `champion` when it beats its baseline and the model has no
    champion yet (`_first_champion`), else its `bert.promotion` tag says why it is not."""
    if score <= baseline:
        reason = f"not champion: {_below(score, baseline)}"
        client.set_model_version_tag(name, version, PROMOTION_TAG, reason)
    else:
        _first_champion(client, name, version, score)


def _below(score: float, baseline: float) -> str:
    return (
        f"dev score {score:.4g} does not beat the task's baseline {baseline:.4g} (the best "
        "answer that ignores the input, on the same dev set)"
    )


def _first_champion(client, name: str, version: str, score: float) -> None:
    """`champion` on `version` when the model has none yet (its first version that beats the
    task's baseline), so a task's model is servable from its first sound run; afterwards only
    `promote` moves it. Two first versions registered at once: the alias ends on one, and only
    that one says it is champion."""
    if by_alias(client, name, CHAMPION) is not None:
        return
    client.set_registered_model_alias(name, CHAMPION, version)
    if str(by_alias(client, name, CHAMPION).version) == str(version):
        reason = "champion: " + FIRST.format(score)
        client.set_model_version_tag(name, version, PROMOTION_TAG, reason)


def by_alias(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:  # no such alias (yet)
        return None


def _score(version, tag: str = SCORE_TAG) -> float:
    """The version's dev score (or its task's baseline, `tag`); a version without a finite one
    is no candidate for champion (a NaN score would win any comparison that does not look)."""
    if tag not in version.tags:
        raise BadValue(
            f"{version.name} version {version.version} has no {tag} tag (registered "
            "by hand, or before the registry recorded it)"
        )
    try:
        score = float(version.tags[tag])
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        what = "dev score" if tag == SCORE_TAG else "baseline score"
        raise BertError(
            f"{version.name} version {version.version}: {what} "
            f"{version.tags[tag]!r} is not a finite number (a diverged "
            "fine-tuning?): not promoted"
        )
    return score


def promote(name: str, version: str | int | None = None, force: bool = False) -> dict:
    """Move `champion` to `version` (default: the `candidate`) when its dev score beats the
    champion's, or with `force`; the decision becomes the version's `bert.promotion` tag."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = tracking_uri()
    client = MlflowClient(uri)
    try:
        client.get_registered_model(name)
    except MlflowException:  # not there: no `bert finetune` of the task registered one
        raise BertError(
            f"no registered model {name!r} at {redacted(uri)}: `bert finetune` of the task "
            "registers it (or name another with --registered-model)"
        ) from None
    if version is None:
        chosen = by_alias(client, name, CANDIDATE)
        if chosen is None:
            raise BadValue(f"{name} has no {CANDIDATE!r} version: name the VERSION")
    else:
        try:
            chosen = client.get_model_version(name, str(version))
        except MlflowException as e:  # no such model or version: the user's to fix
            raise BertError(f"{name} version {version}: {e.message}") from None
    score, champion = _score(chosen), by_alias(client, name, CHAMPION)

    def decision(now, promoted: bool, reason: str) -> dict:  # `now`: the champion after it
        return {
            "registered_model": name,
            "version": int(chosen.version),
            "dev_score": score,
            "champion": None if now is None else int(now.version),
            "promoted": promoted,
            "reason": reason,
        }

    baseline = _score(chosen, BASELINE_TAG)
    if score <= baseline:  # never champion, --force or not: it learned nothing worth serving
        reason = "not promoted: " + _below(score, baseline)
        client.set_model_version_tag(name, chosen.version, PROMOTION_TAG, reason)
        return decision(champion, False, reason)
    if champion is not None and str(champion.version) == str(chosen.version):
        return decision(chosen, False, "already the champion")
    old = None if champion is None else _score(champion)
    promoted = force or old is None or score > old
    if old is None:
        reason = FIRST.format(score)
    else:
        cmp = ">" if score > old else "<="
        reason = f"dev score {score:.4g} {cmp} champion version {champion.version}'s {old:.4g}"
        reason += " (forced)" if force and score <= old else ""
    reason = ("champion: " if promoted else "not promoted: ") + reason
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, chosen.version)
    client.set_model_version_tag(name, chosen.version, PROMOTION_TAG, reason)
    return decision(chosen if promoted else champion, promoted, reason)
