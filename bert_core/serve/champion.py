"""`champion`: which candidate of a task is served, and why.

A task has two registered models (`registry`): its candidates, where `bert finetune` registers
each sound fine-tuning, and its release model, which holds the versions served. `bert promote
TASK [VERSION]` applies this rule: the candidate (default: the newest) becomes champion when
its dev score beats the current champion's (ties keep the champion; `--force` moves it anyway)
and when there is no champion yet; it is then copied into the release model as a new version
(`MlflowClient.copy_model_version`: its source is the candidate, its tags and description the
candidate's), the `champion` alias moves to that copy, and the copy's `bert.promotion` tag
records why. A candidate whose dev score does not beat its task's baseline
(`bert.baseline_score`: the best answer that ignores the input, on the same dev set, e.g.
SST-2's majority label) is never champion, `--force` or not: a model that learned nothing (a
diverged or too short fine-tuning) must not be served; its `bert.promotion` tag says so from
registration on (`on_register`). Serving and batch inference then name the alias, never a
number: `models:/bert-sst2@champion`.

This module is the rule and its record; `registry` registers candidates and tags them with the
scores the rule reads, `bert promote` (`serve.promote`) and the pipelines' promote gates apply
it, `deploy` serves what it chose.
"""

from __future__ import annotations

import math

from bert_core.errors import BadValue, BertError, redacted
from bert_core.tracking import tracking_uri

CHAMPION = "champion"
SCORE_TAG, PROMOTION_TAG = "bert.dev_score", "bert.promotion"
BASELINE_TAG = "bert.baseline_score"  # the task's input-blind answer's score on the same dev set
FIRST = "first champion (dev score {:.4g})"


def on_register(client, name: str, version: str, score: float, baseline: float) -> None:
    """A candidate just registered that does not beat its baseline: its `bert.promotion` tag
    says it can never be champion (written by the identity that registers it, which may not
    touch the release model)."""
    if score <= baseline:
        reason = f"not champion: {_below(score, baseline)}"
        client.set_model_version_tag(name, version, PROMOTION_TAG, reason)


def _below(score: float, baseline: float) -> str:
    return (
        f"dev score {score:.4g} does not beat the task's baseline {baseline:.4g} (the best "
        "answer that ignores the input, on the same dev set)"
    )


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


def _newest(client, name: str):
    versions = client.search_model_versions(f"name='{name}'")
    if not versions:
        raise BadValue(f"{name} has no version yet: `bert finetune` of the task registers one")
    return max(versions, key=lambda v: int(v.version))


def promote(
    release: str, candidates: str, version: str | int | None = None, force: bool = False
) -> dict:
    """Make `candidates`' `version` (default: its newest) `release`'s champion when its dev
    score beats the champion's, or with `force` (never below its baseline): copied into
    `release`, the alias moved to the copy, the decision its `bert.promotion` tag."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = tracking_uri()
    client = MlflowClient(uri)
    try:
        client.get_registered_model(candidates)
    except MlflowException:  # not there (or not readable by this identity)
        raise BertError(
            f"no registered model {candidates!r} at {redacted(uri)}: `bert finetune` of the task "
            "registers its versions there (or name another model with --registered-model)"
        ) from None
    if version is None:
        chosen = _newest(client, candidates)
    else:
        try:
            chosen = client.get_model_version(candidates, str(version))
        except MlflowException as e:  # no such version: the user's to fix
            raise BertError(f"{candidates} version {version}: {e.message}") from None
    score, champion = _score(chosen), by_alias(client, release, CHAMPION)
    source = f"models:/{candidates}/{chosen.version}"

    def decision(now, promoted: bool, reason: str) -> dict:  # `now`: the champion after it
        return {
            "registered_model": release,
            "candidate": f"{candidates}/{chosen.version}",
            "dev_score": score,
            "champion": None if now is None else int(now.version),
            "promoted": promoted,
            "reason": reason,
        }

    baseline = _score(chosen, BASELINE_TAG)
    if score <= baseline:  # never champion, --force or not: it learned nothing worth serving
        return decision(champion, False, "not promoted: " + _below(score, baseline))
    if champion is not None and champion.source == source:
        return decision(champion, False, "already the champion")
    old = None if champion is None else _score(champion)
    promoted = force or old is None or score > old
    if old is None:
        reason = FIRST.format(score)
    else:
        cmp = ">" if score > old else "<="
        reason = f"dev score {score:.4g} {cmp} champion version {champion.version}'s {old:.4g}"
        reason += " (forced)" if force and score <= old else ""
    if not promoted:
        return decision(champion, False, "not promoted: " + reason)
    reason = f"champion: {reason} (from {candidates} version {chosen.version})"
    try:
        copy = client.copy_model_version(source, release)
        client.set_model_version_tag(release, copy.version, PROMOTION_TAG, reason)
        client.set_registered_model_alias(release, CHAMPION, copy.version)
    except MlflowException as e:
        if not _denied(e):
            raise
        raise BertError(
            f"{release}: this identity may not add versions or move {CHAMPION!r} at "
            f"{redacted(uri)} (PERMISSION_DENIED): on a server with authentication only the "
            "release identity may (its credentials as MLFLOW_TRACKING_USERNAME / "
            "MLFLOW_TRACKING_PASSWORD, docs/cluster.md)"
        ) from None
    return decision(copy, True, reason)


def _denied(e: BaseException | None) -> bool:
    """Whether the server refused for lack of permission (403), here or in what caused it:
    MLflow's `copy_model_version` re-raises its version's refusal as another exception."""
    while e is not None:
        if getattr(e, "error_code", None) == "PERMISSION_DENIED":
            return True
        e = e.__cause__
    return False
