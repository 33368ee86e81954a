"""One MemPO RL step in this process, without Ray, Serve or vLLM: the services' own code (the agent loop,
the memory scorer, the advantages, the learner's worker) wired by hand, with a transformers model
generating. The algorithm's end to end in seconds on the tiny model (tests/algorithm/test_rl_step.py);
the pipeline runs the same code as services (tests/scenarios/).

    step = InProcessStep(cfg, world)        # cfg.model.path: the policy
    traj, scores, adv, metrics = step.run(prompts)   # rollout, memory scores, advantages, one update
    step.publish()                          # the learner's weights to the engine and the scorer
    step.close()

The engine samples one token at a time with the KV cache under the turn's seed, and stops as vLLM does
with ``include_stop_str_in_output`` (the token that completes a stop string is kept); its log-probs are
those of the distribution it sampled from. Search runs the search service's own backend in this
process (``load_backend``), answered in the shape the deployment's ``search`` method gives.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from services.algorithm.advantages import compute_advantages
from services.common.codec import encode
from services.common.messages import PromptBatch
from services.config import MempoConfig
from services.learner.samples import training_batch
from services.rollout.agent import AgentLoop
from services.rollout.engine import TurnOutput
from services.rollout.search_client import SearchClient


@dataclass
class Sampling:
    """The fields of vLLM's SamplingParams the agent loop sets."""

    temperature: float
    top_p: float
    max_tokens: int
    stop: list
    seed: int
    logprobs: int = 0


class HFEngine:
    """The rollout engine's interface (services/rollout/engine.py ``generate``) on a transformers model."""

    def __init__(self, model, tokenizer, version: int = 0):
        self.model, self.tokenizer, self.version, self.running = model.eval(), tokenizer, version, 0

    @torch.no_grad()
    def _sample(self, prompt_ids: list[int], p: Sampling) -> tuple[list[int], list[float], str]:
        gen = torch.Generator().manual_seed(p.seed)
        ids, past, out, lps = torch.tensor([prompt_ids]), None, [], []
        for _ in range(p.max_tokens):
            o = self.model(input_ids=ids, past_key_values=past, use_cache=True)
            past, logits = o.past_key_values, o.logits[0, -1].float()
            if p.temperature > 0:
                logp = torch.log_softmax(logits / p.temperature, -1)
                probs = logp.exp()
                if p.top_p < 1.0:  # nucleus: the smallest set of tokens whose mass reaches top_p
                    sp, order = probs.sort(descending=True)
                    sp[(sp.cumsum(0) - sp) > p.top_p] = 0.0
                    probs = torch.zeros_like(probs).scatter(0, order, sp)
                tok = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
            else:
                logp = torch.log_softmax(logits, -1)
                tok = int(logits.argmax())
            out.append(tok)
            lps.append(float(logp[tok]))
            if tok == self.tokenizer.eos_token_id:
                return out, lps, "stop"
            if any(s in self.tokenizer.decode(out) for s in p.stop):
                return out, lps, "stop"
            ids = torch.tensor([[tok]])
        return out, lps, "length"

    async def generate(self, prompt_ids: list[int], params: Sampling, request_id: str | None = None) -> TurnOutput:
        self.running += 1
        t0 = time.perf_counter()
        try:
            ids, lps, finish = self._sample(list(prompt_ids), params)
        finally:
            self.running -= 1
        await asyncio.sleep(0)  # let the other episodes take their turn
        return TurnOutput(ids, lps, finish, self.version, time.perf_counter() - t0)


class LocalAgentLoop(AgentLoop):
    def sampling(self, max_tokens: int, seed: int, temperature: float = -1.0) -> Sampling:
        temperature = self.rc.temperature if temperature < 0 else temperature
        return Sampling(temperature, self.rc.top_p, max_tokens, list(self.rc.stop), seed)


class _Search:
    """The search deployment's ``search`` method on its backend, in this process."""

    def __init__(self, cfg: MempoConfig):
        from services.search_tool.backends import load_backend
        from services.search_tool.service import _hit

        self.index, self._hit = load_backend(cfg), _hit
        self.search = self  # handle.search.remote(queries, topk), as SearchClient calls a Serve handle

    async def remote(self, queries: list[str], topk: int) -> list[list[dict]]:
        return [[self._hit(r, s) for r, s in hits] for hits in self.index.search(queries, topk)]


class InProcessStep:
    def __init__(self, cfg: MempoConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from services.learner.worker import LearnerWorker
        from services.scorer.scorer import MemoryScorer

        self.cfg = cfg
        path = cfg.model.path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.engine = HFEngine(self.policy, self.tokenizer)
        self.agent = LocalAgentLoop(cfg, self.engine, self.tokenizer, SearchClient.from_handle(_Search(cfg), cfg.search))
        self.scorer = MemoryScorer(self.policy, self.tokenizer, cfg)
        self._threads = torch.get_num_threads()  # the worker sets this process's (learner.threads)
        self.learner = LearnerWorker(0, 1, cfg.model_dump(), path)
        self.learner.join(*self.learner.store_address())  # a one-rank group (gloo) in this process

    def run(self, prompts: list):
        """Rollout -> memory scores -> advantages -> one update of the learner's weights; returns
        (TrajectoryBatch, MemoryScoreBatch, Advantages, the learner's metrics)."""
        version = self.engine.version
        batch = PromptBatch(prompts, n=self.cfg.rollout.n, policy_version=version, step=version,
                            seed=self.cfg.train.seed)
        traj = asyncio.run(self.agent.run(batch))
        scores = self.scorer.score_trajectories(traj, version)
        adv = compute_advantages(traj, scores, self.cfg.algorithm)
        metrics = self.learner.train_step(encode(training_batch(traj, adv)))
        return traj, scores, adv, metrics

    def publish(self) -> None:
        """The learner's new weights to the engine and the scorer (one model here), as the next version."""
        self.policy.load_state_dict(self.learner.full_state_dict())
        self.engine.version += 1

    def close(self) -> None:
        self.learner.shutdown()
        torch.set_num_threads(self._threads)
