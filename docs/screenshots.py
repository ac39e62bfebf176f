"""Screenshots of the MLflow UI for docs/mlflow.md, taken from a real `make run`'s store.

    .venv/bin/pip install -e '.[docs]'   # once: Playwright; the browser is the system's Chromium
    .venv/bin/python docs/screenshots.py # after `make run`: writes docs/img/mlflow-*.png

Why a script and not a test: it needs a browser (Debian's `chromium`, or `CHROMIUM=...`), which
a fresh clone does not have; the pictures are documentation, and the numbers in them come from
the run, so rerunning it after a `make run` refreshes them. It starts `mlflow server` on the
project's store (127.0.0.1, a free port), drives headless Chromium with Playwright, and stops
the server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.serving_helpers import free_port, stop_server  # noqa: E402

OUT = ROOT / "docs" / "img"
CHROMIUM_FLAGS = [  # a closed network: no background calls home (they fail, slowly)
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def latest_pipeline_run(client):
    """The newest `make run` parent run and its step runs."""
    from bert_core.track.lineage import PIPELINE_EXPERIMENT, child_runs

    experiment = client.get_experiment_by_name(PIPELINE_EXPERIMENT)
    (parent,) = client.search_runs(
        [experiment.experiment_id],
        filter_string="tags.`bert.step` = 'pipeline' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return experiment, parent, child_runs(parent.info.run_id)


def wait_for(url: str, timeout: float) -> None:
    """Until the tracking server answers `url` (its /health)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def shoot(page, url: str, name: str, wait: str | None = None, height: int = 1000) -> None:
    """`url` once `wait` shows, `height` pixels tall, as docs/img/mlflow-NAME.png."""
    page.set_viewport_size({"width": 1600, "height": height})
    page.goto(url)  # (never "networkidle": the UI polls the server)
    if wait:
        page.get_by_text(wait, exact=True).first.wait_for(timeout=30_000)
    for label in ("Close", "Close assistant"):  # the AI assistant's side panel, when it opens
        button = page.get_by_role("button", name=label)
        if button.count():
            button.first.click()
    time.sleep(1.5)  # charts draw after the data arrive
    page.screenshot(path=str(OUT / f"mlflow-{name}.png"))
    print(OUT / f"mlflow-{name}.png")


def main() -> int:
    from mlflow import MlflowClient
    from playwright.sync_api import sync_playwright

    from bert_core.tracking import tracking_uri

    uri = tracking_uri(existing=True)
    client = MlflowClient(uri)
    experiment, parent, steps = latest_pipeline_run(client)
    finetunes = [r.info.run_id for r in steps if r.data.tags["bert.step"].startswith("finetune")]
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            uri,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{base}/health", timeout=60)
        OUT.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
                args=CHROMIUM_FLAGS,
            )
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            exp = experiment.experiment_id
            shoot(
                page,
                f"{base}/#/experiments/{exp}/runs/{parent.info.run_id}",
                "pipeline-run",
                wait="eval/score",
            )
            runs = json.dumps(finetunes)
            shoot(
                page,
                f"{base}/#/compare-runs?runs={runs}&experiments={json.dumps([exp])}",
                "compare",
                wait="dev/score",
                height=2300,
            )
            shoot(page, f"{base}/#/models", "registry", wait="bert-sst2")
            shoot(page, f"{base}/#/models/bert-sst2", "registered-model", wait="champion")
            browser.close()
    finally:
        stop_server(server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
