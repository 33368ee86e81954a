"""What a config deploys, whether a cluster can hold it, and the Serve config files made from it.

    mempo plan deploy/configs/gpu-qwen2.5-7b.yaml                    # replicas, CPUs, GPUs, resources, totals
    mempo plan CONFIG ray.address=auto                                # ... and whether the running cluster fits
    mempo plan CONFIG --node 2*CPU=64,GPU=8 --node CPU=8,head_node=1  # ... or whether these nodes would
    mempo plan deploy/configs/tiny.yaml --serve-config deploy/serve_config.yaml [--check]
    mempo plan deploy/configs/gpu-qwen2.5-7b.yaml --kuberay deploy/kuberay/rayservice.yaml [--check]

The recipe (a config in deploy/configs/) is the one source. Each service's Serve options come from
its own ``deployment_options(cfg)``, the same function ``mempo train`` deploys with, so the plan, a
training run, deploy/serve_config.yaml and the KubeRay manifest's ``serveConfigV2`` say the same
thing; ``--check`` (and tests/pipeline/test_plan.py) fails when a committed file has drifted.

A config with ``search.url`` (an external Search-R1 server) deploys no search service: the plan, the
fit check and the Serve config leave it out (``deployed``).

Fit: every actor the config starts (replicas, and the learner's FSDP workers) is placed first-fit,
largest first, on the nodes' total resources. A service whose actor fits no node at all, or a sum
the cluster does not have, is an error naming the numbers; Ray's own scheduler may still find a
packing where first-fit found none, which is reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from services.config import MempoConfig, learner_worker_gpus
from services.common.local_ray import init_keeping_sigterm, join_options
from services.pipeline.registry import ROOT, SERVICES, app_name, route_prefix

SERVE_CONFIG_HEADER = """\
# Ray Serve config for the mempo services, GENERATED from {config} by
#   mempo plan {config} --serve-config {path}
# Do not edit the values here: change the recipe and run that command again (tests/pipeline/test_plan.py
# fails when this file and the recipe disagree). `serve deploy {path}` against a running cluster
# (`ray start --head`), or `serve run {path}` to start one and deploy.
# Each service is its own application and deployment, so each scales and fails on its own. Every
# application is built by services/pipeline/serve_apps.py from the mempo config (args.config);
# relative paths resolve against the project root. The cluster runs with Ray token authentication
# (docs/deploy.md): `serve deploy` sends the token from RAY_AUTH_TOKEN or ~/.ray/auth_token.
# http_options.host 0.0.0.0 exposes only the services' REST endpoints, and those ask for a bearer token
# (ray.http_auth=token): set {token_env} on every node, or mount a file and name it in ray.http_token_file
# (docs/deploy.md, "REST authentication"). Only /health answers without it.
"""


@dataclass
class Actors:
    """One kind of Ray actor a config starts: ``count`` of them at start (``max_count`` when autoscaling)."""

    service: str
    what: str
    count: int
    max_count: int
    cpus: float
    gpus: float
    resources: dict = field(default_factory=dict)

    def demand(self) -> dict[str, float]:
        out = {"CPU": self.cpus, "GPU": self.gpus, **self.resources}
        return {k: v for k, v in out.items() if v}


def deployed(cfg: MempoConfig, services=tuple(SERVICES)) -> list[str]:
    """The services of ``services`` that ``cfg`` deploys, in deploy order: all but search when ``search.url``
    names an external Search-R1 server (the rollout calls that one instead)."""
    return [name for name in SERVICES if name in services and not (name == "search" and cfg.search.url)]


def deployments(cfg: MempoConfig) -> dict[str, dict]:
    """Each deployed service's Serve deployment options, exactly as ``mempo train`` deploys them."""
    return {name: SERVICES[name].options(cfg) for name in deployed(cfg)}


def actors(cfg: MempoConfig, services=tuple(SERVICES)) -> list[Actors]:
    """Every kind of actor the chosen services start, from their deployment options."""
    out = []
    for service, opts in deployments(cfg).items():
        if service not in services:
            continue
        auto = opts.get("autoscaling_config")
        count = auto["initial_replicas"] if auto else opts["num_replicas"]
        most = auto["max_replicas"] if auto else count
        a = opts["ray_actor_options"]
        out.append(Actors(service, "replica", count, most, a.get("num_cpus", 0), a.get("num_gpus", 0),
                          a.get("resources", {})))
        if service == "learner":
            lr = cfg.learner
            out.append(Actors("learner", "FSDP worker", lr.world_size, lr.world_size, lr.num_cpus_per_worker,
                              learner_worker_gpus(cfg), dict(lr.resources)))
    return out


def totals(units: list[Actors], at_most: bool = False) -> dict[str, float]:
    out: dict[str, float] = {}
    for u in units:
        for k, v in u.demand().items():
            out[k] = out.get(k, 0.0) + v * (u.max_count if at_most else u.count)
    return out


def fit(units: list[Actors], nodes: list[dict[str, float]]) -> tuple[list[str], list[str]]:
    """(errors, warnings) of placing every actor at its start count on ``nodes`` (total resources each)."""
    errors, warnings = [], []
    have = {}
    for node in nodes:
        for k, v in node.items():
            have[k] = have.get(k, 0.0) + v
    for k, v in totals(units).items():
        if v > have.get(k, 0.0) + 1e-9:
            errors.append(f"the services need {k} {v:g} in all; the cluster has {have.get(k, 0.0):g}")
    free = [dict(n) for n in nodes]
    items = sorted((u for u in units for _ in range(u.count)),
                   key=lambda u: (u.gpus, u.cpus, sum(u.resources.values())), reverse=True)
    for u in items:
        need = u.demand()
        if not any(all(n.get(k, 0.0) + 1e-9 >= v for k, v in need.items()) for n in nodes):
            msg = f"a {u.service} {u.what} needs {_fmt(need)}; no node has that much"
            if msg not in errors:
                errors.append(msg)
            continue
        for n in free:
            if all(n.get(k, 0.0) + 1e-9 >= v for k, v in need.items()):
                for k, v in need.items():
                    n[k] -= v
                break
        else:
            warnings.append(f"first-fit found no room left for a {u.service} {u.what} ({_fmt(need)})")
    return errors, warnings


def _fmt(demand: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in demand.items()) or "nothing"


def describe(units: list[Actors]) -> str:
    """The plan as a table and totals."""
    rows = [("service", "actor", "count", "CPU", "GPU", "resources")]
    for u in units:
        count = f"{u.count}" if u.count == u.max_count else f"{u.count}..{u.max_count}"
        rows.append((u.service, u.what, count, f"{u.cpus:g}", f"{u.gpus:g}",
                     ", ".join(f"{k}={v:g}" for k, v in u.resources.items()) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    start, most = totals(units), totals(units, at_most=True)
    lines.append(f"cluster needs at start: {_fmt(start)}")
    if most != start:
        lines.append(f"cluster needs at most (autoscaling at its maximum): {_fmt(most)}")
    return "\n".join(lines)


def fewest_ranks(hf, lc, dtype, with_ref: bool, card_bytes: float, most: int = 64) -> int | None:
    """The fewest learner ranks (FSDP shards) whose estimated peak (services/learner/memory.py) fits
    ``card_bytes`` each; None if even ``most`` do not."""
    from services.learner.memory import estimate_peak  # torch on use: the plan's arithmetic needs none otherwise

    return next((w for w in range(1, most + 1) if estimate_peak(hf, lc, w, dtype, with_ref)["total"] <= card_bytes),
                None)


def learner_memory(cfg: MempoConfig, card_gib: float) -> list[str]:
    """What one learner rank needs at peak by services/learner/memory.py's estimate, from the model's
    config.json under ``model.path`` (none read, no lines, when this machine does not have it), and, when
    the ranks run on GPUs, the fewest ranks whose estimate fits a ``card_gib`` GiB card, with LoRA
    (``learner.lora``; rank 16 when the config trains every parameter) and without."""
    from services.common.model_io import model_dtype  # torch on use (as fewest_ranks)
    from services.learner.memory import GIB, estimate_peak, heap_kept  # torch on use (as fewest_ranks)

    if not (Path(cfg.model.path) / "config.json").is_file():
        return []
    from transformers import AutoConfig  # transformers on use

    hf = AutoConfig.from_pretrained(cfg.model.path)
    lc, dtype, with_ref = cfg.learner, model_dtype(cfg.model.dtype), cfg.learner.kl_coef > 0
    gpus = learner_worker_gpus(cfg)
    est = estimate_peak(hf, lc, lc.world_size, dtype, with_ref, heap_kept=heap_kept(lc, "cuda" if gpus else "cpu"))
    parts = ", ".join(f"{k} {est[k] / GIB:.1f}" for k in ("states", "activations", "head", "slack", "runtime"))
    what = f"LoRA rank {lc.lora.rank}" if lc.lora.rank else "every parameter"
    lines = [f"learner: estimated peak {est['total'] / GIB:.1f} GiB per rank at learner.world_size={lc.world_size} "
             f"({what}, {str(dtype).removeprefix('torch.')}; {parts} GiB; {est['params'] / 1e9:.2f}B parameters)"]
    if gpus:
        # this config's mode, and the other one (LoRA off, or LoRA of rank 16 on)
        other = lc.model_copy(update={"lora": lc.lora.model_copy(update={"rank": 0 if lc.lora.rank else 16})})
        need, other_need = (fewest_ranks(hf, c, dtype, with_ref, card_gib * GIB) for c in (lc, other))
        by_lora_rank = {lc.lora.rank: need, other.lora.rank: other_need}  # 0: every parameter
        said = "; ".join(f"{f'LoRA rank {r}' if r else 'every parameter'} {by_lora_rank[r] or 'more than 64'}"
                         for r in sorted(by_lora_rank))
        lines.append(f"learner: fewest ranks (GPUs) whose estimate fits a {card_gib:g} GiB card: {said}")
        if need is None or need > lc.world_size:
            lines.append(f"warning: learner.world_size={lc.world_size} is below that ({need or 'more than 64'}) for "
                         f"{card_gib:g} GiB cards: the ranks would warn at start and may run out of memory")
    return lines


def parse_nodes(specs: list[str]) -> list[dict[str, float]]:
    """``["2*CPU=64,GPU=8", "CPU=8,head_node=1"]`` -> three nodes' total resources."""
    nodes = []
    for spec in specs:
        count, _, body = spec.rpartition("*") if "*" in spec else ("1", "", spec)
        try:
            n = int(count)
            node = {k.strip(): float(v) for k, v in (part.split("=", 1) for part in body.split(",") if part.strip())}
        except ValueError:
            raise ValueError(f"node spec {spec!r}: expected [COUNT*]NAME=AMOUNT,..., e.g. 2*CPU=64,GPU=8") from None
        if n < 1 or not node:
            raise ValueError(f"node spec {spec!r}: needs a count >= 1 and at least one resource")
        nodes += [dict(node) for _ in range(n)]
    return nodes


def live_nodes() -> list[dict[str, float]]:
    """Total resources of each live node of the cluster this process is connected to."""
    import ray  # Ray on use: the plan's arithmetic and files need no cluster

    return [{k: v for k, v in n["Resources"].items() if not k.startswith("node:")} for n in ray.nodes() if n["Alive"]]


def cluster_nodes(address: str) -> list[dict[str, float]]:
    """:func:`live_nodes` of the cluster at ``address`` (joined if this process is not connected yet)."""
    import ray  # Ray on use (see live_nodes)

    if not ray.is_initialized():
        init_keeping_sigterm(**join_options(address))
    return live_nodes()


def serve_config(cfg: MempoConfig, config_arg: str) -> dict:
    """The Serve config file (``serve deploy``) of the services ``cfg`` deploys (the four, or three with
    ``search.url``), from ``cfg``: each application's
    import path and args, and its deployment's options as ``mempo train`` sets them. HTTP listens on
    every interface of a cluster node (only the REST endpoints; see the file's header), so the REST routes
    ask for the bearer token (``ray.http_auth=token``) unless the recipe turns it off."""
    def args():  # one dict each, or the YAML dump writes anchors
        return {"config": config_arg, **({"overrides": ["ray.http_auth=token"]} if cfg.ray.http_auth == "auto" else {})}

    apps = [{"name": app_name(cfg, service), "route_prefix": route_prefix(cfg, service),
             "import_path": f"services.pipeline.serve_apps:{service}", "args": args(),
             "deployments": [{"name": service, **opts}]} for service, opts in deployments(cfg).items()]
    return {"proxy_location": cfg.ray.proxy_location, "http_options": {"host": "0.0.0.0", "port": cfg.ray.http_port},
            "applications": apps}


def http_warnings(cfg: MempoConfig, generated: bool) -> list[str]:
    """What ``mempo plan`` warns about the REST routes: open (no bearer token asked for) where HTTP listens
    beyond loopback, as ``ray.http_host`` says or, with ``generated`` (a Serve config or KubeRay manifest
    written from ``cfg``), on every interface."""
    host = "0.0.0.0" if generated else cfg.ray.http_host
    if host in ("127.0.0.1", "localhost", "::1") or cfg.ray.http_auth == "token":
        return []
    if cfg.ray.http_auth == "auto" and generated:
        return []  # the generated files require the token (serve_config)
    how = "ask for no token (ray.http_auth=none)" if cfg.ray.http_auth == "none" else \
        f"ask for a token only if {cfg.ray.http_token_env} or ray.http_token_file holds one on the replica's node"
    return [f"HTTP listens on {host}:{cfg.ray.http_port} and the REST routes (scorer, search) {how}: anyone who "
            f"reaches the port can use them. Set ray.http_auth=token and give the token by environment or file "
            f"(docs/deploy.md, 'REST authentication')"]


def serve_config_text(cfg: MempoConfig, config_arg: str, path: str) -> str:
    return (SERVE_CONFIG_HEADER.format(config=config_arg, path=path, token_env=cfg.ray.http_token_env)
            + yaml.safe_dump(serve_config(cfg, config_arg), sort_keys=False, width=110))


def kuberay_config_path(manifest: dict, config_rel: str) -> str:
    """Where the recipe is inside the image: the head container's workingDir + the repo-relative path."""
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return f"{head.get('workingDir', '/app').rstrip('/')}/{config_rel}"


def kuberay_with_serve_config(text: str, serve: dict) -> str:
    """The manifest text with its ``serveConfigV2`` block replaced by ``serve`` (the rest untouched)."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == "  serveConfigV2: |"), None)
    if start is None:
        raise ValueError("the manifest has no '  serveConfigV2: |' block under spec")
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith("    ")):
        end += 1
    body = yaml.safe_dump(serve, sort_keys=False, width=110)
    block = "".join(f"    {line}\n" for line in body.splitlines())
    return "".join(lines[: start + 1]) + block + "".join(lines[end:])


def kuberay_nodes(manifest: dict, at_most: bool) -> list[dict[str, float]]:
    """Total resources of the manifest's head and worker pods (worker groups at min or max replicas)."""
    spec = manifest["spec"]["rayClusterConfig"]
    groups = [(spec["headGroupSpec"], 1)]
    for g in spec.get("workerGroupSpecs", []):
        replicas = g.get("replicas", 1)
        groups.append((g, g.get("maxReplicas", replicas) if at_most else g.get("minReplicas", replicas)))
    nodes = []
    for group, count in groups:
        params = group.get("rayStartParams", {}) or {}
        limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        cpus = float(params.get("num-cpus", _cpu_quantity(limits.get("cpu", "0"))))
        node = {"CPU": cpus, "GPU": float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))}
        node.update({k: float(v) for k, v in yaml.safe_load(params.get("resources", "{}") or "{}").items()})
        nodes += [dict(node) for _ in range(int(count))]
    return nodes


def _cpu_quantity(q: str) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def config_relpath(path: str) -> str:
    """A config path as the repository names it (deploy/configs/...), for the generated files."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(path)
