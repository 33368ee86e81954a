"""The config sections every service reads: the policy model, its vLLM engine, and the Ray cluster.

A section belongs to the package whose code it configures (``services/<package>/settings.py``); these
three are shared by the rollout, the scorer and the learner alike, so they live in common.
services/config.py composes every section into one tree; see it for loading and overrides.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.config_fields import Section


class ModelConfig(Section):
    path: str = Field(
        "world",
        description="Policy model directory; 'world' means the embedded tiny model built by `mempo world`.",
    )
    hidden_size: int = Field(
        128, ge=32,
        description="Tiny model: hidden size (num_attention_heads * head_dim).",
    )
    num_layers: int = Field(
        2, ge=1,
        description="Tiny model: decoder layers.",
    )
    num_attention_heads: int = Field(
        2, ge=1,
        description="Tiny model: attention heads.",
    )
    num_key_value_heads: int = Field(
        1, ge=1,
        description="Tiny model: key/value heads (GQA).",
    )
    head_dim: int = Field(
        64,
        description="Tiny model: head dim; vLLM's CPU attention needs one of 32, 64, 80, 96, 112, 128, ...",
    )
    intermediate_size: int = Field(
        256, ge=1,
        description="Tiny model: MLP width.",
    )
    max_position_embeddings: int = Field(
        4096, ge=128,
        description="Tiny model: longest sequence.",
    )
    seed: int = Field(
        0,
        description="Seed of the tiny model's random init.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype; auto = bf16 on GPU, fp32 on CPU.",
    )


class EngineConfig(Section):
    max_model_len: int = Field(
        4096, ge=64,
        description="vLLM max_model_len (context + generation).",
    )
    gpu_memory_utilization: float = Field(
        0.6, gt=0.0, le=1.0,
        description="vLLM gpu_memory_utilization (GPU only).",
    )
    enforce_eager: bool = Field(
        True,
        description="Disable CUDA graphs / torch.compile (fast start; required in tests).",
    )
    seed: int = Field(
        0,
        description="vLLM engine seed.",
    )
    cpu_kv_cache_gib: int = Field(
        1, ge=1,
        description="VLLM_CPU_KVCACHE_SPACE on CPU machines, GiB.",
    )
    max_num_seqs: int = Field(
        64, ge=1,
        description="vLLM max_num_seqs: sequences batched per engine step.",
    )
    cpu_threads: int = Field(
        0, ge=-1,
        description=(
            "CPU machines only: OpenMP threads of the vLLM worker, left unpinned so the replica shares the cores "
            "Ray gives it; 0 = the rollout replica's reserved CPUs (rollout.num_cpus) rounded down, at least 1; -1 "
            "= vLLM's own binding (one pinned thread per core of the machine). Ignored when "
            "VLLM_CPU_OMP_THREADS_BIND is set in the environment."
        ),
    )
    cpu_executor: Literal["uni", "mp"] = Field(
        "uni",
        description=(
            "CPU machines only: where the vLLM worker (the model) runs. uni = inside the engine core's process: "
            "one process fewer to start with the engine, and no queue between two processes polled while the "
            "engine idles (waiting for searches, scores or the learner). mp = a process of its own, vLLM's CPU "
            "default, which it needs to pin OpenMP threads: uni applies only with unpinned threads "
            "(engine.cpu_threads >= 0, or VLLM_CPU_OMP_THREADS_BIND=nobind), otherwise mp is used."
        ),
    )


class RayConfig(Section):
    address: str = Field(
        "",
        description="Ray address; empty starts a local cluster.",
    )
    num_cpus: int = Field(
        0, ge=0,
        description="CPUs of a local cluster; 0 = all.",
    )
    object_store_memory: int = Field(
        1_000_000_000, ge=78_643_200,
        description="Object store bytes of a local cluster.",
    )
    http_host: str = Field(
        "127.0.0.1",
        description="Serve HTTP host.",
    )
    http_port: int = Field(
        8000, ge=1, le=65535,
        description="Serve HTTP port.",
    )
    http_auth: Literal["auto", "token", "none"] = Field(
        "auto",
        description=(
            "Bearer-token authentication of the REST routes (every route but /health): token = a replica that "
            "finds no token (ray.http_token_file, else the environment variable ray.http_token_env) refuses to "
            "start; auto = closed when a token is found, open otherwise; none = open. Use token wherever HTTP "
            "listens beyond loopback (docs/deploy.md)."
        ),
    )
    http_token_env: str = Field(
        "MEMPO_API_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description=(
            "The environment variable that holds the REST token on the nodes running REST replicas (on KubeRay, "
            "set from a Secret); clients (mempo score, mempo view --serve) read the same variable."
        ),
    )
    http_token_file: str = Field(
        "",
        description=(
            "A file holding the REST token (a mounted Secret), read by each REST replica at start; takes "
            "precedence over ray.http_token_env. Never put the token itself in a config file."
        ),
    )
    proxy_location: Literal["EveryNode", "HeadOnly", "Disabled"] = Field(
        "EveryNode",
        description=(
            "Where Serve runs its HTTP proxies: every node with a replica (clients may hit any node), the head "
            "only, or none (in-cluster handles only). Several nodes on one machine share an address, so only "
            "HeadOnly can hold the port there."
        ),
    )
    replica_wait_s: float = Field(
        0.0, ge=0,
        description=(
            "How long a call waits for a replacement replica that Serve is starting and that fits a live node (a "
            "lost node's replica re-placed on a survivor) before the step fails; 0 = 600 s plus 60 s per GiB of "
            "the model's weights (a cold vLLM start on a loaded machine). A replacement that fits no live node "
            "fails the call at once."
        ),
    )
    autoscaler: bool = Field(
        False,
        description=(
            "The cluster adds nodes on demand (KubeRay, the cluster launcher): a replacement replica that fits no "
            "live node is waited for, up to ray.replica_wait_s, instead of failing the call at once."
        ),
    )
    call_timeout_s: float = Field(
        1800.0, ge=0,
        description=(
            "Longest one training call (a rollout call, a scoring call, the learner's wait for their results) may "
            "take before the step fails with an error naming it (a node lost with no replacement, an object no "
            "copy of which survived); 0 = no limit."
        ),
    )
    app_prefix: str = Field(
        "",
        description=(
            "Prefix of the pipeline's Serve application names (search, rollout, scorer, learner), so two pipelines "
            "can share a cluster; a non-empty prefix also sets rollout.search_app and learner.publish_to to match."
        ),
    )
