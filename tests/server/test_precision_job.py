"""The server measures the precision decision in the background once, when precision "auto" found
none stored, and never while one is stored (spark_lsp.precision_job)."""

from __future__ import annotations

import asyncio
import os

import pytest
import tiny_models
from conftest import SERVER, start_editor


async def _serve(model, cache):
    async def transport(client):
        await client.start_io(
            *SERVER, "--model", str(model), env={**os.environ, "SPARK_LSP_CACHE": str(cache)}
        )

    return await start_editor(model, {"tunePrecision": True}, transport=transport)


async def _logs_until(client, needle: str, seconds: float) -> list[str]:
    for _ in range(int(seconds * 10)):
        texts = [m.message for m in client.log_messages]
        if any(needle in t for t in texts):
            return texts
        await asyncio.sleep(0.1)
    return [m.message for m in client.log_messages]


@pytest.mark.slow
async def test_a_model_without_a_decision_is_measured_once_in_the_background(tiny_llama, tmp_path):
    model = tiny_models.copy_model(tiny_llama, tmp_path / "model")
    cache = tmp_path / "cache"
    client, ed = await _serve(model, cache)
    try:
        m = await ed.metrics()
        assert (
            m["engine"]["precision"] == "fp32"
            and "no stored decision" in m["engine"]["precisionReason"]
        )
        logs = await _logs_until(client, "precision decision for", 240)
        assert any("measuring the weight precision" in t for t in logs), logs
        assert any(
            "precision decision for" in t and "applies from the next load" in t for t in logs
        ), logs
        assert list((cache / "precision").glob("*.json"))  # stored where Engine.load reads it
        assert (await ed.command("spark.status"))["loaded"]  # the server kept serving throughout
    finally:
        await client.shutdown_session()
        await client.stop()

    client, ed = await _serve(model, cache)  # the next load reads it, and nothing is measured again
    try:
        m = await ed.metrics()
        assert "no stored decision" not in m["engine"]["precisionReason"], m["engine"]
        await asyncio.sleep(1.0)
        assert not any("measuring the weight precision" in m.message for m in client.log_messages)
    finally:
        await client.shutdown_session()
        await client.stop()
