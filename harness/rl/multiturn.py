"""Multi-turn rollouts with tools and environments (rl.tools, rl.environment_factory), TRL 1.16's tool loop built
token-in/token-out, in lockstep across the ranks.

Per generation, each rank's rows (its contiguous slice of the step's completions):
  reset(**row) per rollout -> prompt ids (rendered with the row's tools; an observation appended to the last
  message) -> turns: generate every row still going -> parse the turn's tool calls -> call them -> append the tool
  suffix ids (harness/rl/chat_turns.py) -> the next turn, until every row of every rank has finished.

A row ends (`finish`) at a turn with no tool call that ends in EOS (eos), at a turn cut by the token budget
(length: max_completion_length counts every token after the prompt, tool tokens included), at a turn whose tool
results would leave no room for another token (budget: the results are rolled back, as TRL does), at a turn with
tool calls once rl.max_tool_calling_iterations rounds ran (max_iterations), or at a tool past rl.tool_timeout_s under
rl.reward_errors zero (error: its rewards are 0).

Lockstep: under ZeRO-3 each generate call is collective (the weights are gathered for it), so per turn every rank
all-reduces "rows still going" and, while any rank has one, every rank calls generate (a rank without rows runs a
dummy row). Each turn of each row samples from its own stream (seed, generation, global row, turn), so the rollouts
do not depend on the world size, the batching, or a resume.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist

from harness.errors import UsageError
from harness.rl import chat_turns, tools
from harness.rl.generation.sampling import turn_seed


@dataclass
class Rollout:
    """One row's conversation as it grows: the ids after the prompt and, per id, whether the model sampled it."""

    row: int  # its global row in the step (its sampling streams)
    where: str  # how errors name it
    prompt_ids: list[int]
    prompt: list  # the prompt messages (with the reset's observation)
    environment: object
    tools: dict
    completion: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)  # 1 sampled, 0 tool suffix
    logps: list[float] = field(default_factory=list)  # sampling log-probs (0.0 on tool tokens, as TRL's)
    replies: list[dict] = field(default_factory=list)  # assistant and tool messages (the rewards' completion)
    turns: list[dict] = field(default_factory=list)
    finish: str | None = None
    rounds: int = 0
    calls: int = 0
    failures: int = 0

    def record(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion, "tool_mask": self.tool_mask,
                "sampling_logps": self.logps, "turns": self.turns, "finish": self.finish,
                "tool_calls": self.calls, "tool_failures": self.failures}


def any_rank(count: int) -> bool:
    """Whether any rank still has rows going (an all-reduce of the max: every rank calls it once per turn)."""
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return count > 0
    device = torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([count], dtype=torch.long, device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return int(t.item()) > 0


class MultiTurn:
    def __init__(self, rl: dict, tokenizer, toolbox: tools.Toolbox, generator, prompt_field: str = "prompt"):
        self.rl, self.tok, self.box, self.generator = rl, tokenizer, toolbox, generator
        self.kwargs = dict(rl.get("chat_template_kwargs") or {})
        self.max_len = int(rl["max_completion_length"])
        cap = rl.get("max_tool_calling_iterations")
        self.cap = float("inf") if cap is None else int(cap)
        self.timeout_s, self.result_cap = rl.get("tool_timeout_s"), rl.get("max_tool_result_tokens")
        self.eos = {tokenizer.eos_token_id}
        self.prompt_field = prompt_field

    def start(self, prompts: list, prompt_ids: list[list[int]], columns: dict, rows: list[int],
              names: list[str]) -> list[Rollout]:
        """The rows' rollouts with their environments reset (TRL: reset(**row); an observation is appended to the
        prompt's last message)."""
        kinds = [self.box.env_name(columns, i, names[i]) for i in range(len(rows))]
        envs = self.box.environments(kinds) or [None] * len(rows)
        out = []
        for i, (prompt, ids, row, env, name) in enumerate(zip(prompts, prompt_ids, rows, envs, kinds)):
            if env is not None:
                kwargs = {self.prompt_field: prompt, **{k: v[i] for k, v in columns.items()}}
                if self.box.multi:
                    kwargs.pop(tools.ENV_COLUMN, None)
                try:
                    observation = env.reset(**kwargs)
                except Exception as err:  # noqa: BLE001 - the user's environment
                    raise UsageError(f"{names[i]}: {type(env).__name__}.reset raised {type(err).__name__}: {err}\n"
                                     "    fix: make reset(**row) accept every dataset column of the row") from None
                if observation is not None:
                    prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
                    ids = chat_turns.render(self.tok, prompt, tools=self.box.schemas[name] or None,
                                            generation_prompt=True, kwargs=self.kwargs)
            out.append(Rollout(row, names[i], list(ids), prompt, env, self.box.callables(env)))
        return out

    def run(self, rollouts: list[Rollout], seed: int) -> None:
        """Every turn of every row, in lockstep with the other ranks."""
        turn, self.generate_s = 0, 0.0  # generate_s: the generate calls' share (the rest: tools and templates)
        while any_rank(len(going := [r for r in rollouts if r.finish is None])):
            budgets = [self.max_len - len(r.completion) for r in going]
            began = time.perf_counter()
            outs = self.generator.generate([r.prompt_ids + r.completion for r in going], seed=turn_seed(seed, turn),
                                           row_ids=[r.row for r in going], max_new=max(budgets, default=1))
            self.generate_s += time.perf_counter() - began
            logps = getattr(self.generator, "last_logps", None) or [[] for _ in going]
            for r, ids, lp, budget in zip(going, outs, logps, budgets):
                self._turn(r, list(ids)[:budget], list(lp)[:budget])
            turn += 1

    def _turn(self, r: Rollout, ids: list[int], logps: list[float]) -> None:
        reply = chat_turns.parse(self.tok, ids, r.prompt_ids + r.completion)
        r.completion += ids
        r.tool_mask += [1] * len(ids)
        r.logps += logps + [0.0] * (len(ids) - len(logps))
        r.replies.append(reply)
        turn = {"ids": ids}
        r.turns.append(turn)
        calls = reply.get("tool_calls")
        if not ids or ids[-1] not in self.eos:
            r.finish = "length"
        elif not calls:
            r.finish = "eos"
        elif r.rounds >= self.cap:
            r.finish = "max_iterations"
        if r.finish is not None:
            return
        results = [self._call(r, c) for c in calls]
        turn["tool_calls"] = [c.get("function", c) for c in calls]
        if r.finish == "error":
            return
        turn["tool_results"] = [m["content"] for m in results]
        suffix = chat_turns.suffix_ids(self.tok, results, self.kwargs)
        if suffix is None:
            raise UsageError(f"{r.where}: the chat template rendered this row's tool results with earlier turns "
                             "changed (not prefix-preserving): training on it would train tokens never sampled\n"
                             "    fix: a training chat template that keeps earlier turns as they were")
        if len(r.completion) + len(suffix) >= self.max_len:
            r.finish, turn["rolled_back"] = "budget", True
            return
        r.completion += suffix
        r.tool_mask += [0] * len(suffix)
        r.logps += [0.0] * len(suffix)
        r.replies += results
        r.rounds += 1

    def _call(self, r: Rollout, call: dict) -> dict:
        fn = call.get("function", call)
        name = fn.get("name", "unknown")
        r.calls += 1
        tool = r.tools.get(name) if call.get("type", "function") == "function" else None
        try:
            if tool is None:
                raise ValueError(f"Tool {name} not found." if call.get("type", "function") == "function"
                                 else f"Unsupported tool call type: {call.get('type')}")
            result, failed = tools.call(tool, fn.get("arguments") or {}, self.timeout_s)
        except ValueError as err:
            result, failed = {"error": str(err)}, True
        except tools.ToolTimeout as err:
            if self.rl.get("reward_errors", "stop") == "stop":
                raise UsageError(f"{r.where}: tool call {name}({fn.get('arguments')}) {err}\n    fix: raise "
                                 "rl.tool_timeout_s, fix the tool, or set rl.reward_errors=zero to end such rows "
                                 "with reward 0 (counted in tools/timeouts)") from None
            r.finish, result, failed = "error", {"error": str(err)}, True
        r.failures += int(failed)
        return tools.message(name, self._capped(result))

    def _capped(self, result):
        if self.result_cap is None or isinstance(result, list):
            return result
        ids = self.tok(str(result), add_special_tokens=False)["input_ids"]
        return result if len(ids) <= self.result_cap else self.tok.decode(ids[:self.result_cap])


def describe(rl: dict, box: tools.Toolbox) -> str:
    """The start-up line of a multi-turn run."""
    envs = ", ".join(f"{k}: {c.__name__}" if k else c.__name__ for k, c in (box.factories or {}).items()) or "none"
    names = sorted({s["function"]["name"] for schemas in box.schemas.values() for s in schemas})
    cap = rl.get("max_tool_calling_iterations")
    return (f"multi-turn: tools {', '.join(names)}; environments {envs}; "
            f"max_tool_calling_iterations {'none (no cap)' if cap is None else cap}, max_completion_length "
            f"{rl['max_completion_length']} tokens counting tool results; later turns are prompt + sampled ids + "
            "the template's tool suffix ids (never re-tokenized), tool tokens carry no loss")
