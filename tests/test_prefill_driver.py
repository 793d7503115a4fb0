"""The prefill driver's contract with the pipeline, against a scripted pipeline: with one stage a job's reply
goes out when that job is done, not when its round is; a round that fails fails only the jobs not yet answered."""

from __future__ import annotations

import asyncio
import threading

import pytest

from prefill_service.driver import Driver, Outcome, PrefillFailed
from prefill_service.messages import Job, StageReport


def job(rid: str) -> Job:
    return Job(rid, (1, 2, 3), 0.0, 1.0, 0, "peer", {})


class ScriptedPipeline:
    """Reports job 0 through on_job, then holds the round until released (and optionally fails it)."""

    def __init__(self, fail: bool = False, world: int = 1):
        self.release, self.fail, self.rounds, self.world = threading.Event(), fail, [], world

    def lead(self, rnd, on_job=None):
        self.rounds.append(len(rnd.jobs))
        reports = [[StageReport(0, j.request_id, first_token=7)] for j in rnd.jobs]
        on_job(0, reports[0])
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("stage died")
        return reports

    def shutdown(self):
        pass


@pytest.mark.parametrize("fail", [False, True])
def test_a_job_is_answered_when_it_is_done_not_when_its_round_is(fail):
    async def main():
        pipe = ScriptedPipeline(fail)
        driver = Driver(pipe, batch_tokens=100, loop=asyncio.get_running_loop())
        with driver._cv:  # both queued before the driver thread forms the round
            first, second = driver.submit(job("a"), 30), driver.submit(job("b"), 30)
        out = await asyncio.wait_for(first, 5)
        assert isinstance(out, Outcome) and out.reports[0].first_token == 7
        assert not second.done() and pipe.rounds == [2]
        pipe.release.set()
        if fail:
            with pytest.raises(PrefillFailed, match="stage died"):
                await asyncio.wait_for(second, 5)
        else:
            assert (await asyncio.wait_for(second, 5)).job.request_id == "b"
        await asyncio.to_thread(driver.close)
    asyncio.run(main())


def test_a_job_whose_answer_fails_is_answered_by_the_round_failure():
    class Metrics:
        queue = type("G", (), {"set": lambda self, v: None})()

        def observe(self, job, reports):
            raise RuntimeError("metrics broke")

    async def main():
        pipe = ScriptedPipeline(fail=True)
        driver = Driver(pipe, batch_tokens=100, loop=asyncio.get_running_loop(), metrics=Metrics())
        with driver._cv:
            first = driver.submit(job("a"), 30)
        pipe.release.set()
        with pytest.raises(PrefillFailed):
            await asyncio.wait_for(first, 5)
        await asyncio.to_thread(driver.close)
    asyncio.run(main())


def test_a_round_failing_between_stages_breaks_the_pipeline():
    """With several stages an exception out of a round means the stages' collectives are out of step: the round's
    unanswered and the queued requests get UNAVAILABLE, new ones are refused, and the server is told."""
    async def main():
        pipe, told = ScriptedPipeline(fail=True, world=2), []
        driver = Driver(pipe, batch_tokens=6, loop=asyncio.get_running_loop(), on_broken=told.append)
        with driver._cv:
            first, second, queued = (driver.submit(job(r), 30) for r in "abc")  # a round holds a and b
        await asyncio.wait_for(first, 5)
        pipe.release.set()
        for fut in (second, queued):
            with pytest.raises(PrefillFailed) as e:
                await asyncio.wait_for(fut, 5)
            assert e.value.code == "UNAVAILABLE"
        with pytest.raises(PrefillFailed, match="broken"):
            driver.submit(job("d"), 30)
        assert told and "stage died" in told[0]
        await asyncio.to_thread(driver.close)
    asyncio.run(main())
