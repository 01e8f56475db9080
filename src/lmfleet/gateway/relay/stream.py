"""The relay of a streamed answer: the backend's bytes to the client, what arrives together going out together.

This is the per-chunk path (benchmarks/bench_relay.py): a read is scanned for a few substrings and passed on;
only the usage event, an error event, or a provider's own model name is parsed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from lmfleet.gateway.observe.recorder import Outcome
from lmfleet.gateway.relay import sse
from lmfleet.gateway.relay.backend import Backend
from lmfleet.gateway.relay.race import CANCELLED
from lmfleet.gateway.relay.rewrite import rewrite, take_usage
from lmfleet.gateway.relay.upstream import STREAM_ERRORS, OpenStream
from lmfleet.gateway.relay.usage import ESTIMATED, PROVIDER, StreamText, count_usage, estimate

if TYPE_CHECKING:
    from lmfleet.gateway.relay.run import RequestRun

log = logging.getLogger("lmfleet.gateway")


async def relay_stream(run: RequestRun, st: OpenStream, b: Backend, slot: Any, ttft: float,
                       answered: str | None) -> AsyncIterator[bytes]:
    """Relay the stream: what arrives together goes out together, as the backend's own bytes.

    Most reads (a local model's token events) pass through untouched after a few substring scans; only
    a read that carries the usage event, an error event, or a provider's own model name is parsed
    (``answered``: the name its first events carry). A provider's blocks are kept (:class:`StreamText`) to
    count the answer's tokens should no usage arrive; a local engine always sends usage (its chunks count
    otherwise), and its token events are not held or parsed.
    """
    usage: tuple[int, int] | None = None
    chunks = 0
    done = False
    status = 200
    seen = StreamText() if b is not run.m.local else None
    renamed = st.endpoint.upstream_model != run.req.model or answered not in (None, run.req.model)
    rename = run.req.model if renamed else None
    usage_marker = st.endpoint.dialect.usage_marker  # what the dialect's usage event carries
    try:
        async with asyncio.timeout(max(0.0, run.remaining())):
            async for block in st.blocks():
                if rename is not None or b'"error"' in block:
                    block, n, usage, done, failed = rewrite(sse.split_events(block), usage, done,
                                                             rename, run.req.wants_usage)
                    if failed:
                        status = 502
                elif usage_marker in block:  # the usage event (one per stream): only it is parsed
                    block, usage = take_usage(block, usage, run.req.wants_usage)
                    n = sse.count_choices(block)
                    done = done or sse.DONE in block
                else:
                    n = sse.count_choices(block)
                    done = done or sse.DONE in block
                chunks += n
                if block:  # one write, no waiting for more
                    if seen is not None:
                        seen.add(block)
                    yield block
        if not done and status == 200:
            status = 502
            yield sse.error_event(f"the stream from {b.label} ended without [DONE] after {chunks} chunks",
                                  code="upstream_truncated")
    except TimeoutError:
        status = 504
        yield sse.error_event(f"request exceeded {run.m.app.cfg.deployment.request_timeout_s:g} s",
                              code="timeout")
    except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream: neutral, recorded
        status = CANCELLED
        raise
    except STREAM_ERRORS as ex:
        status = 502
        log.warning("model %s: stream from %s broke after %d chunks: %s", run.m.name, b.label, chunks,
                    type(ex).__name__)
        yield sse.error_event(f"the stream from {b.label} broke after {chunks} chunks ({type(ex).__name__})",
                              code="upstream_stream_error")
    finally:
        await st.aclose()
        source = PROVIDER
        if usage is None:  # never free: counted with the model's tokenizer
            source = ESTIMATED
            text = seen.text() if seen is not None else None
            args = (run.m.tokenizer, run.req.kind, run.req.body, text, run.prompt_tokens, chunks,
                    run.counted_prompt)
            # a client that left cancels the task: counted here and now, no await that could be cut short (a
            # prompt counted for the context check is not tokenized again)
            usage = count_usage(*args) if status == CANCELLED else await estimate(*args)
        in_tokens, out_tokens = usage
        if status == 200:
            b.finish(slot, out_tokens)
        elif status == CANCELLED:
            b.cancel(slot)
        else:
            b.break_stream(slot, out_tokens, timed_out=status == 504)
        run.ended = (b, slot, Outcome(b.label, run.reason.value, in_tokens, out_tokens, ttft, status,
                                      usage_source=source, upstream_model=answered))
