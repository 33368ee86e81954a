"""A service whose replicas fail in start-up is reported at the command line with the replica's own
exception (the path and setting involved), not only in Ray's logs (services/pipeline/start_errors.py)."""

import json

import pytest
from ray import serve

from services.cli import main
from services.learner.checkpoint import MARKER, step_dir
from services.pipeline.start_errors import innermost_exception

# The shape of a Serve deployment's status message after a constructor failed through a Ray task.
SERVE_MESSAGE = """The deployment failed to start 3 times in a row. This may be due to a problem with its \
constructor or initial health check failing. See controller logs for details. Error:
\x1b[36mray::ServeReplica:learner:learner.initialize_and_get_metadata()\x1b[39m (pid=1, ip=127.0.0.1)
  File "/x/ray/serve/_private/replica.py", line 1928, in initialize
    raise RuntimeError(traceback.format_exc()) from None
RuntimeError: Traceback (most recent call last):
  File "/x/services/learner/service.py", line 105, in __init__
    resumed = self.group.resume(self.cfg.train.run_dir)
ray.exceptions.RayTaskError(FileNotFoundError): \x1b[36mray::LearnerWorker.load_checkpoint()\x1b[39m (pid=2)
  File "/x/services/learner/checkpoint.py", line 101, in rng_file
    raise FileNotFoundError(f"{f} is missing")
FileNotFoundError: runs/x/rng_rank0.pt is missing
  and a second line of its message
"""


def test_innermost_exception_skips_the_wrappers():
    assert innermost_exception(SERVE_MESSAGE) == "FileNotFoundError: runs/x/rng_rank0.pt is missing\n" \
                                                 "  and a second line of its message"
    assert innermost_exception("ModuleNotFoundError: No module named 'vllm'") == \
        "ModuleNotFoundError: No module named 'vllm'"
    assert innermost_exception("no exception here") == ""


@pytest.mark.slow
def test_learner_start_failure_reaches_the_cli(serve_http, world, tmp_path, capsys):
    """A damaged checkpoint (complete, but its RNG file gone) makes every learner replica fail in its
    constructor; `mempo serve` exits 1 and prints the missing file and the setting that skips it."""
    run = tmp_path / "run"
    ckpt = step_dir(run, 3)
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 3, "sched": {}, "world_size": 1, "extra": {}}))
    (ckpt / MARKER).write_text("ok\n")
    port = serve_http.rsplit(":", 1)[1]
    try:
        code = main(["serve", "deploy/configs/tiny.yaml", f"train.run_dir={run}", f"ray.http_port={port}",
                     "ray.app_prefix=startfail-", "learner.num_cpus_per_worker=0.1", "learner.kl_coef=0",
                     "--apps", "learner"])
    finally:
        serve.delete("startfail-learner")
    err = capsys.readouterr().err
    assert code == 1, err
    assert "the learner service failed to start: FileNotFoundError" in err, err
    assert f"{ckpt}/rng_rank0.pt is missing" in err and "learner.resume=never" in err, err
