"""`mempo plan`: the deploy plan of a config, its fit on a cluster, and the drift check of the generated
Serve config (deploy/serve_config.yaml) and KubeRay manifest (deploy/kuberay/rayservice.yaml)."""

from pathlib import Path

import pytest
import yaml

from services.cli import main
from services.config import ConfigError, load_config
from services.pipeline import plan

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "deploy" / "configs" / "tiny.yaml")
GPU = str(ROOT / "deploy" / "configs" / "gpu-qwen2.5-7b.yaml")


def test_committed_serve_config_and_kuberay_manifest_match_their_recipes(capsys):
    # the drift check the issue asks for: both generated files equal what the recipes generate now
    assert main(["plan", "deploy/configs/tiny.yaml", "--serve-config", "deploy/serve_config.yaml", "--check"]) == 0
    assert main(["plan", "deploy/configs/gpu-qwen2.5-7b.yaml", "--kuberay", "deploy/kuberay/rayservice.yaml",
                 "--check"]) == 0
    out = capsys.readouterr().out
    assert "deploy/serve_config.yaml matches the recipe" in out and "rayservice.yaml matches the recipe" in out
    assert "fits deploy/kuberay/rayservice.yaml's 5 pod(s) at maxReplicas" in out


def test_every_kuberay_pod_loads_the_proxy_middleware_mempo_sets_on_its_own_nodes():
    # a REST request whose replica dies answers 503 + Retry-After on Kubernetes as on the nodes mempo starts
    from services.common.local_ray import SERVE_NODE_ENV

    spec = yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    key = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get(key) == SERVE_NODE_ENV[key], (container["name"], env)


def test_every_kuberay_pod_gives_rest_replicas_the_recipes_token_from_a_secret():
    # the GPU recipe closes the REST routes (ray.http_auth: token): a replica on any pod must find the token
    cfg = load_config(GPU, [])
    assert cfg.ray.http_auth == "token"
    spec = yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            assert "secretKeyRef" in env[cfg.ray.http_token_env]["valueFrom"], (container["name"], env)


def test_the_generated_serve_config_closes_the_rest_routes_and_plan_warns_where_they_are_open(capsys):
    tiny = load_config(TINY, [])
    assert tiny.ray.http_auth == "auto" and tiny.ray.http_host == "127.0.0.1"
    # HTTP on 0.0.0.0 in the generated file: every application asks for the token
    for app in plan.serve_config(tiny, "deploy/configs/tiny.yaml")["applications"]:
        assert app["args"]["overrides"] == ["ray.http_auth=token"]
    assert plan.http_warnings(tiny, generated=False) == [] == plan.http_warnings(tiny, generated=True)
    wide = load_config(TINY, ["ray.http_host=0.0.0.0"])
    assert "ray.http_auth=token" in plan.http_warnings(wide, generated=False)[0]
    assert plan.http_warnings(load_config(TINY, ["ray.http_host=0.0.0.0", "ray.http_auth=token"]), False) == []
    off = load_config(TINY, ["ray.http_auth=none"])  # turned off by the recipe: the file leaves it off, plan warns
    assert "overrides" not in plan.serve_config(off, "x.yaml")["applications"][0]["args"]
    assert "no token" in plan.http_warnings(off, generated=True)[0]
    assert main(["plan", TINY, "ray.http_host=0.0.0.0"]) == 0
    assert "warning: HTTP listens on 0.0.0.0:8000" in capsys.readouterr().out


def test_gpu_recipe_plan_prints_every_service_and_the_totals(capsys):
    # ray.address emptied: the recipe's "auto" would check whatever cluster this machine runs (the test
    # session's own); tests/scenarios/test_multinode.py checks a live cluster
    assert main(["plan", "deploy/configs/gpu-qwen2.5-7b.yaml", "ray.address="]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:3]) for line in out.splitlines()}
    assert {("rollout", "replica", "4"), ("scorer", "replica", "1"), ("search", "replica", "2..8")} <= rows
    assert "cluster needs at start: CPU 36, GPU 7" in out  # 4x(4,1) + (4,1) + 2 search x 4 + 2 ranks x (4,1)
    assert "cluster needs at most (autoscaling at its maximum): CPU 60, GPU 7" in out


def test_a_cluster_that_cannot_hold_the_plan_fails_with_the_numbers(capsys):
    assert main(["plan", "deploy/configs/gpu-qwen2.5-7b.yaml", "--node", "CPU=64,GPU=4"]) == 1
    err = capsys.readouterr().err
    assert "the services need GPU 7 in all; the cluster has 4" in err
    assert main(["plan", "deploy/configs/gpu-qwen2.5-7b.yaml", "--node", "2*CPU=32,GPU=4"]) == 0
    # enough in sum, but no single node can host a rollout replica's CPUs
    assert main(["plan", "deploy/configs/gpu-qwen2.5-7b.yaml", "--node", "16*CPU=3,GPU=1"]) == 1
    assert "a rollout replica needs CPU 4, GPU 1; no node has that much" in capsys.readouterr().err


def test_custom_resources_reach_the_deployments_and_the_plan():
    cfg = load_config(TINY, ["rollout.resources={rollout_node: 1}", "scorer.resources={scorer_node: 1}",
                             "learner.resources={learner_node: 1}", "learner.world_size=2"])
    opts = plan.deployments(cfg)
    assert opts["rollout"]["ray_actor_options"]["resources"] == {"rollout_node": 1.0}
    assert opts["scorer"]["ray_actor_options"]["resources"] == {"scorer_node": 1.0}
    assert "resources" not in opts["search"]["ray_actor_options"]  # none asked: deployed as before
    assert opts["learner"]["ray_actor_options"]["resources"] == {"learner_node": 0.001}  # runs beside its workers
    need = plan.totals(plan.actors(cfg))
    assert need["rollout_node"] == 1 and need["scorer_node"] == 1 and need["learner_node"] == pytest.approx(2.001)
    head, w1, w2 = {"CPU": 2, "learner_node": 100}, {"CPU": 1, "rollout_node": 1}, {"CPU": 1, "scorer_node": 1}
    assert plan.fit(plan.actors(cfg), [head, w1, w2]) == ([], [])
    errors, _ = plan.fit(plan.actors(cfg), [head, w1])
    assert errors == ["the services need scorer_node 1 in all; the cluster has 0",
                      "a scorer replica needs CPU 0.5, scorer_node 1; no node has that much"]


def test_bad_resources_and_node_specs_are_refused():
    with pytest.raises(ConfigError, match="learner.resources"):
        load_config(TINY, ["learner.resources={GPU: 1}"])
    with pytest.raises(ConfigError, match="rollout.resources"):
        load_config(TINY, ["rollout.resources={rollout_node: -1}"])
    assert plan.parse_nodes(["2*CPU=8,GPU=1", "CPU=2"]) == [{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}, {"CPU": 2}]
    for bad in ("CPU", "x*CPU=1", "0*CPU=1", "CPU=lots"):
        with pytest.raises(ValueError, match="node spec"):
            plan.parse_nodes([bad])
    assert main(["plan", "deploy/configs/tiny.yaml", "--node", "CPU"]) == 2


def test_drift_is_detected_and_rewriting_fixes_it(tmp_path, capsys):
    serve_file = tmp_path / "serve_config.yaml"
    manifest = tmp_path / "rayservice.yaml"
    manifest.write_text((ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text())
    assert main(["plan", TINY, "--serve-config", str(serve_file), "--check"]) == 1  # missing
    assert main(["plan", TINY, "--serve-config", str(serve_file)]) == 0
    edited = yaml.safe_load(serve_file.read_text())
    edited["applications"][1]["deployments"][0]["num_replicas"] = 3  # a hand edit
    serve_file.write_text(yaml.safe_dump(edited))
    assert main(["plan", TINY, "--serve-config", str(serve_file), "--check"]) == 1
    assert "has drifted from the recipe" in capsys.readouterr().err
    # the manifest: only serveConfigV2 changes; the cluster spec around it stays byte for byte
    text = manifest.read_text()
    manifest.write_text(text.replace("num_replicas: 4", "num_replicas: 5"))
    assert main(["plan", GPU, "--kuberay", str(manifest), "--check"]) == 1
    assert main(["plan", GPU, "--kuberay", str(manifest)]) == 0
    assert manifest.read_text() == text
    # what is not a RayService manifest, or not YAML, is refused with a message, not a traceback
    for i, body in enumerate(["kind: ConfigMap\n", "- a\n", "", "a: [\n"]):
        bad = tmp_path / f"bad{i}.yaml"
        bad.write_text(body)
        assert main(["plan", GPU, "--kuberay", str(bad)]) == 2
    assert "is not a RayService manifest" in capsys.readouterr().err
    # generated files take the recipe as it is
    assert main(["plan", TINY, "rollout.replicas=2", "--serve-config", str(serve_file)]) == 2


def _qwen7b_config(folder):
    """Qwen2.5-7B's shape as a config.json (no weights): what `mempo plan` reads of model.path."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False).save_pretrained(folder)
    return str(folder)


def test_plan_says_how_many_learner_gpus_each_recipe_needs_with_and_without_lora(tmp_path, capsys):
    model = _qwen7b_config(tmp_path)
    lora = "deploy/configs/gpu-qwen2.5-7b-lora.yaml"
    assert main(["plan", lora, f"model.path={model}", "ray.address="]) == 0
    out = capsys.readouterr().out
    assert "learner: estimated peak" in out and "(LoRA rank 64, bfloat16;" in out and "7.62B parameters" in out
    assert "fits a 80 GiB card: every parameter 4; LoRA rank 64 1" in out
    assert "warning: learner.world_size" not in out
    assert "cluster needs at start: CPU 32, GPU 6" in out  # the full recipe's 7 less one learner rank
    assert main(["plan", "deploy/configs/gpu-qwen2.5-7b.yaml", f"model.path={model}", "ray.address="]) == 0
    out = capsys.readouterr().out  # every parameter at W=2: too much for 80 GiB cards, enough for 141 GiB ones
    assert "every parameter, bfloat16" in out and "warning: learner.world_size=2 is below that (4)" in out
    assert main(["plan", "deploy/configs/gpu-qwen2.5-7b.yaml", f"model.path={model}", "ray.address=",
                 "--gpu-memory", "141"]) == 0
    out = capsys.readouterr().out
    assert "fits a 141 GiB card: every parameter 2; LoRA rank 16 1" in out and "warning: learner" not in out


def test_plan_prints_no_learner_memory_without_the_models_config():
    assert plan.learner_memory(load_config(GPU), 80.0) == []  # /shared/models/... is not on this machine
