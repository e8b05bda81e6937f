"""What typed payloads cost: dispatch and drain of a small pydantic model vs the same dict.

Two kumiko jobs with the same no-op handler body, one typed (``payload: Order``, a model of
five fields, one of them a list of a nested model), one untyped (``payload: dict``). Each
round dispatches the same payloads, as dicts (what a web handler has), to one of them, then
drains them with 8 threads; typed and untyped rounds alternate. A third comparison dispatches
``Order`` instances instead of dicts. Target: within 10 % (ratio >= 0.90).

Rates on a shared 2-core machine swing by more than that from round to round, so the suite
also times the pure work per message without Redis, which noise barely moves: what dispatch
does with a payload (``payload_to_enqueue``: the limits alone for a dict; validate, dump,
limits and the model's check of its own JSON for a model) and what a worker does before the
handler (``load_payload``: nothing for a dict; ``model_validate_json``).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.payloads import load_payload, payload_to_enqueue

from .harness import Comparison, Countdown, alternate, timed

if TYPE_CHECKING:
    from .run import Bench

WORKER_THREADS = 8
MICRO_CALLS = 20_000


class Line(BaseModel):
    sku: str
    quantity: int


class Order(BaseModel):
    order_id: str
    customer: str
    amount: float
    express: bool = False
    lines: list[Line] = []


def payload(n: int) -> dict[str, Any]:
    return {
        "order_id": f"A-{n}",
        "customer": "ada@example.com",
        "amount": 12.5,
        "express": n % 2 == 0,
        "lines": [{"sku": "mug", "quantity": 2}, {"sku": "tea", "quantity": 1}],
    }


class TypedBench:
    def __init__(self, bench: Bench) -> None:
        self.bench = bench

    def registry(self, countdown: Countdown | None) -> Registry:
        feature = Feature("bench")

        @feature.job("typed")
        def typed(payload: Order, ctx: JobContext) -> None:
            if countdown is not None:
                countdown.hit()

        @feature.job("untyped")
        def untyped(payload: dict[str, Any], ctx: JobContext) -> None:
            if countdown is not None:
                countdown.hit()

        return Registry([feature])

    def runner(self, prefix: str, countdown: Countdown | None) -> JobRunner:
        return JobRunner(
            self.registry(countdown),
            redis_url=self.bench.redis_url,
            queue_prefix=prefix,
            worker_threads=WORKER_THREADS,
        )

    def __call__(self) -> None:
        bench = self.bench
        n = bench.messages
        dispatch = Comparison("`dispatch`: small model vs the same dict", "msg/s", "kumiko dict")
        instances = Comparison(
            "`dispatch` of model instances vs dicts to an untyped job", "msg/s", "kumiko dict"
        )
        drain = Comparison("drain: small model vs the same dict, 8 threads", "msg/s", "kumiko dict")
        payloads = [payload(i) for i in range(n)]
        models = [Order.model_validate(each) for each in payloads]

        def round_of(job: str, rates: list[float], cpu: list[float], drained: list[float]) -> None:
            prefix = f"bt{uuid.uuid4().hex[:6]}"
            countdown = Countdown(n)
            runner = self.runner(prefix, countdown)
            with timed() as t:
                for each in payloads:
                    runner.dispatch(f"bench:job:{job}", each)
            rates.append(n / t[0].wall_s)
            cpu.append(t[0].cpu_s / n * 1e6)
            with timed() as t:
                runner.start()
                countdown.wait()
            runner.stop()
            drained.append(n / t[0].wall_s)
            if job == "typed":
                drain.kumiko_cpu_us.append(t[0].cpu_s / n * 1e6)
            else:
                drain.plain_cpu_us.append(t[0].cpu_s / n * 1e6)
            bench.flush(prefix)

        def typed_round() -> None:
            round_of("typed", dispatch.kumiko, dispatch.kumiko_cpu_us, drain.kumiko)

        def untyped_round() -> None:
            round_of("untyped", dispatch.plain, dispatch.plain_cpu_us, drain.plain)

        def dispatch_only(job: str, items: list[Any], rates: list[float], cpu: list[float]) -> None:
            prefix = f"bt{uuid.uuid4().hex[:6]}"
            runner = self.runner(prefix, None)
            with timed() as t:
                for each in items:
                    runner.dispatch(f"bench:job:{job}", each)
            rates.append(n / t[0].wall_s)
            cpu.append(t[0].cpu_s / n * 1e6)
            runner.stop()
            bench.flush(prefix)

        def instance_round() -> None:
            dispatch_only("typed", models, instances.kumiko, instances.kumiko_cpu_us)

        def dict_round() -> None:
            dispatch_only("untyped", payloads, instances.plain, instances.plain_cpu_us)

        alternate(bench.rounds, typed_round, untyped_round)
        alternate(bench.rounds, instance_round, dict_round)
        bench.comparisons += [dispatch, instances, drain]
        bench.extra["typed_payload_work_us_per_message"] = self.micro()

    def micro(self) -> dict[str, float]:
        """Microseconds per message of the payload work alone, no Redis (best of 5 runs)."""
        registry = self.registry(None)
        typed, untyped = registry.jobs["bench:job:typed"], registry.jobs["bench:job:untyped"]
        sample = payload(1)
        model = Order.model_validate(sample)
        enqueued = payload_to_enqueue(typed, sample, max_bytes=1_048_576)

        def best(call: Any) -> float:
            runs = []
            for _ in range(5):
                began = time.perf_counter()
                for _ in range(MICRO_CALLS):
                    call()
                runs.append((time.perf_counter() - began) / MICRO_CALLS * 1e6)
            return round(min(runs), 2)

        return {
            "dispatch_dict_untyped": best(
                lambda: payload_to_enqueue(untyped, sample, max_bytes=1_048_576)
            ),
            "dispatch_dict_typed": best(
                lambda: payload_to_enqueue(typed, sample, max_bytes=1_048_576)
            ),
            "dispatch_instance_typed": best(
                lambda: payload_to_enqueue(typed, model, max_bytes=1_048_576)
            ),
            "worker_untyped": best(lambda: load_payload(untyped, enqueued)),
            "worker_typed": best(lambda: load_payload(typed, enqueued)),
        }
