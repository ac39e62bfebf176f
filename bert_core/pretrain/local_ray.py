"""A private, one-run Ray on this machine (`bert pretrain` without `RAY_ADDRESS`).

Every Ray worker process of the instance (Ray Train's controller and its helper actors, the
training workers, the driver's mailbox) runs `quiet_worker_logs` as its setup hook, so Ray imports
this module in each of them: it imports nothing heavy. Hooked from `command` (which imports
torch and MLflow), each of those processes spent ~2 s of CPU on imports it never used, about a
quarter of a short run's CPU on 2 cores (measured: 56 CPU-s for 20 tiny steps).
"""

from __future__ import annotations

import logging
import os
from typing import Any

# Ray Train v2's own variables (ray/train/v2/_internal/constants.py) for a private one-run Ray:
# the controller polls its workers every 0.2 s, not 2 s (a run's start and end are each seen up
# to a poll later), and starts no preemption watcher, metrics actors or state reconciliation
# (for cloud spot instances and the dashboard, which a private instance has neither of; each a
# process to start): ~10 s of a short run. A variable set in the environment wins.
LOCAL_RAY_TRAIN = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
}


def quiet_worker_logs() -> None:
    """Ray worker setup hook: without a dashboard (a bare local cluster) Ray Train's placement
    group cleaner warns every few seconds that the state API is unavailable; silence it."""
    logging.getLogger(
        "ray.train.v2._internal.execution.controller.placement_group_cleaner"
    ).setLevel(logging.ERROR)


def init_local_ray(num_cpus: int, **kwargs: Any) -> None:
    """Start a private local Ray instance (never attach to someone else's `ray start`)."""
    import ray

    env_vars = {name: os.environ.get(name, value) for name, value in LOCAL_RAY_TRAIN.items()}
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        runtime_env={"worker_process_setup_hook": quiet_worker_logs, "env_vars": env_vars},
        **kwargs,
    )
