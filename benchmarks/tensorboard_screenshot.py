"""A fit of the main job's GPT (examples/gpt.py) with evaluation, logged by zeroray.tracking's
TensorBoardCallback, then a PNG of TensorBoard's scalars page for it, taken with a headless
Chromium through playwright: what a user sees after ``tensorboard --logdir``.

    python benchmarks/tensorboard_screenshot.py --out /tmp/tensorboard_scalars.png
    python benchmarks/tensorboard_screenshot.py --out x.png --chromium /usr/bin/chromium --steps 60

Needs the tensorboard extra and playwright (``pip install playwright``) with a Chromium:
``playwright install chromium``, or a system one named by ``--chromium`` (Debian's ``chromium``
package where playwright's download is not reachable). TensorBoard runs on a free local port
in its own process group and is ended when the page is taken.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from common import add_import_paths  # noqa: E402

add_import_paths()

import torch  # noqa: E402

import gpt  # noqa: E402
import zeroray as zr  # noqa: E402
from zeroray.tracking import TensorBoardCallback  # noqa: E402


def accuracy(model, batch):
    """The share of next bytes the model ranks first."""
    idx, tgt = batch
    return {"accuracy": (model(idx).argmax(-1) == tgt).float().mean()}


def train(log_dir: str, steps: int, eval_every: int, num_workers: int) -> None:
    cfg = gpt.GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2)
    data = gpt.CharBatches(8, cfg.seq_len, steps, seed=0)
    held_out = list(gpt.CharBatches(8, cfg.seq_len, 2, seed=1))
    with TensorBoardCallback(log_dir) as tb, zr.Trainer(
            lambda: gpt.GPT(cfg), gpt.gpt_loss, optimizer=zr.AdamW(lr=3e-3), zero=zr.ZeroConfig(stage=2),
            scaling=zr.ScalingConfig(num_workers=num_workers)) as trainer:
        results = trainer.fit(data, progress=False, eval_data=held_out, eval_every=eval_every,
                              eval_metric_fn=accuracy, callbacks=[tb])
    last = results[-1]
    print(f"fit: {len(results)} steps, loss {results[0].loss:.4f} -> {last.loss:.4f}, "
          f"eval {last.evaluation}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_tags(url: str, timeout_s: float) -> None:
    """Until TensorBoard serves the run's scalar tags: it reads the log directory in the background,
    and a page opened before that shows no data."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if b"train/loss" in urllib.request.urlopen(url, timeout=5).read():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"TensorBoard served no train/loss at {url} within {timeout_s} s")
        time.sleep(0.5)


def screenshot(log_dir: str, out: str, chromium: str | None) -> None:
    from playwright.sync_api import sync_playwright

    port = free_port()
    board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", log_dir, "--port", str(port),
                              "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # its own process group: ended below by its id
    try:
        wait_for_tags(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", 300)
        with sync_playwright() as p:
            browser = p.chromium.launch(headless=True, executable_path=chromium)
            page = browser.new_page(viewport={"width": 1600, "height": 1100})
            page.goto(f"http://127.0.0.1:{port}/#scalars", wait_until="networkidle", timeout=120_000)
            page.wait_for_selector("text=train/loss", timeout=120_000)
            time.sleep(10)  # the charts draw after their data arrives
            page.screenshot(path=out, full_page=True)
            browser.close()
        print(f"screenshot: {out}")
    finally:
        os.killpg(board.pid, signal.SIGTERM)
        board.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--log-dir", default=None, help="where the event file goes (default: a temporary directory)")
    ap.add_argument("--chromium", default=None, help="a Chromium executable (default: playwright's own)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--no-fit", action="store_true", help="only the screenshot, of the runs already in --log-dir")
    args = ap.parse_args()
    torch.manual_seed(0)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="zeroray_tb_")
    if not args.no_fit:
        train(log_dir, args.steps, args.eval_every, args.num_workers)
    screenshot(log_dir, args.out, args.chromium)


if __name__ == "__main__":
    main()
