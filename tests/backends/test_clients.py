"""The remote backend clients against a local replay of Ollama's and OpenAI's streaming formats:
request bodies, FIM layouts, streaming, one pooled connection, cancel that reaches the server,
errors reported once with back-off, API keys that never leak."""

from __future__ import annotations

import pytest

from spark_lsp.backends import BackendError, BackendUnavailable, FileChunk, Request
from spark_lsp.backends.http import Health
from spark_lsp.backends.llamacpp import LlamaCppBackend
from spark_lsp.backends.ollama import OllamaBackend
from spark_lsp.backends.openai import OpenAIBackend


def read_all(stream) -> str:
    return "".join(c.text for c in stream)


@pytest.fixture
def backends():
    made = []

    def make(cls, url, model="qwen2.5-coder:1.5b-base", **kw):
        b = cls(url, model, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def test_ollama_fim_request_and_stream(fake, backends):
    b = backends(OllamaBackend, fake.url)
    s = b.infill(
        Request(
            prefix="def add(a, b):\n    ", suffix="\n\nprint(1)\n", max_tokens=20, stop=("\n\n",)
        )
    )
    assert read_all(s) == "return a + b\n"
    assert (
        s.finish_reason == "stop" and s.stats["new_tokens"] == 5 and s.stats["server_tokens"] == 5
    )
    path, body = fake.requests[-1]
    assert path == "/api/generate"
    assert body["prompt"] == "def add(a, b):\n    " and body["suffix"] == "\n\nprint(1)\n"
    assert body["stream"] is True and "raw" not in body
    assert body["options"]["num_predict"] == 20 and body["options"]["stop"] == ["\n\n"]


def test_ollama_explicit_template_sends_raw_prompt(fake, backends):
    b = backends(OllamaBackend, fake.url, fim_template="qwen")
    read_all(
        b.infill(
            Request(
                prefix="x = ",
                suffix="\n",
                extra=(FileChunk("util.py", "def f(): pass"),),
                path="main.py",
            )
        )
    )
    body = fake.requests[-1][1]
    assert body["raw"] is True and "suffix" not in body
    assert body["prompt"] == (
        "<|repo_name|>workspace\n<|file_sep|>util.py\ndef f(): pass\n"
        "<|file_sep|>main.py\n<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>"
    )
    assert "<|endoftext|>" in body["options"]["stop"] and "<|file_sep|>" in body["options"]["stop"]


def test_ollama_model_without_insert_switches_to_raw_fim(fake, backends):
    fake.mode = "no-insert"
    b = backends(OllamaBackend, fake.url, model="deepseek-coder:1.3b")
    assert read_all(b.infill(Request(prefix="a", suffix="b"))) == "return a + b\n"
    assert fake.requests[-1][1]["prompt"] == "<｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜>"
    assert b.status()["fim"] == "raw deepseek" and b.status()["failed"] == 0
    b2 = backends(OllamaBackend, fake.url, model="some-model")  # family unknown: a clear error
    with pytest.raises(BackendError, match="does not support insert.*set 'fimTemplate'"):
        read_all(b2.infill(Request(prefix="a", suffix="b")))


def test_ollama_chat_and_plain_prompt(fake, backends):
    b = backends(OllamaBackend, fake.url)
    assert b.supports_chat
    msgs = ({"role": "user", "content": "rename x"},)
    assert read_all(b.infill(Request(messages=msgs))) == "return a + b\n"
    assert fake.requests[-1][0] == "/api/chat" and fake.requests[-1][1]["messages"] == list(msgs)
    read_all(b.infill(Request(prefix="import os\n", suffix=None)))
    assert fake.requests[-1][1]["raw"] is True and "suffix" not in fake.requests[-1][1]


def test_ollama_needs_a_model(fake, backends):
    b = backends(OllamaBackend, fake.url, model=None)
    with pytest.raises(BackendError, match="backendModel"):
        b.infill(Request(prefix="a", suffix="b"))


@pytest.mark.parametrize(
    "model, fim, expect_prompt, expect_suffix",
    [
        ("Qwen/Qwen2.5-Coder-7B", None, "<|fim_prefix|>p<|fim_suffix|>s<|fim_middle|>", None),
        ("bigcode/starcoder2-3b", None, "<fim_prefix>p<fim_suffix>s<fim_middle>", None),
        ("codellama/CodeLlama-7b-hf", None, "<PRE> p <SUF>s <MID>", None),
        ("codestral-22b", None, "[SUFFIX]s[PREFIX]p", None),
        ("my-model", None, "p", "s"),  # unknown family: the server's suffix parameter
        ("Qwen/Qwen2.5-Coder-7B", "suffix", "p", "s"),  # forced
        ("my-model", "<A>{prefix}<B>{suffix}<C>", "<A>p<B>s<C>", None),
    ],
)
def test_openai_fim_layouts(fake, backends, model, fim, expect_prompt, expect_suffix):
    b = backends(OpenAIBackend, fake.url, model=model, fim_template=fim)
    assert read_all(b.infill(Request(prefix="p", suffix="s", max_tokens=7))) == "return a + b\n"
    path, body = fake.requests[-1]
    assert path == "/v1/completions" and body["model"] == model and body["stream"] is True
    assert (
        body["prompt"] == expect_prompt
        and body.get("suffix") == expect_suffix
        and body["max_tokens"] == 7
    )


def test_openai_chat_and_usage(fake, backends):
    b = backends(OpenAIBackend, fake.url, model="gpt-x")
    s = b.infill(Request(messages=({"role": "user", "content": "hi"},), max_tokens=3))
    assert read_all(s) == "return a +"
    assert s.finish_reason == "length" and s.stats["server_tokens"] == 3
    assert fake.requests[-1][0] == "/v1/chat/completions"


def test_llamacpp_infill_request_and_stream(fake, backends):
    b = backends(LlamaCppBackend, fake.url, model=None)
    s = b.infill(
        Request(
            prefix="def add(a, b):\n    ",
            suffix="\n",
            max_tokens=3,
            stop=("\n\n",),
            extra=(FileChunk("util.py", "X = 1\n"),),
        )
    )
    assert read_all(s) == "return a +" and s.finish_reason == "length"
    assert s.stats["server_tokens"] == 3 and s.stats["server_cached_tokens"] == 10
    path, body = fake.requests[-1]
    assert (
        path == "/infill"
        and body["input_prefix"] == "def add(a, b):\n    "
        and body["input_suffix"] == "\n"
    )
    assert body["input_extra"] == [{"filename": "util.py", "text": "X = 1\n"}]
    assert body["cache_prompt"] is True and body["stream"] is True and body["n_predict"] == 3
    assert read_all(b.infill(Request(prefix="import os\n", suffix=None))) == "return a + b\n"
    assert fake.requests[-1][0] == "/completion" and fake.requests[-1][1]["prompt"] == "import os\n"


def test_llamacpp_chat_goes_to_openai_endpoint(fake, backends):
    b = backends(LlamaCppBackend, fake.url, model=None)
    assert (
        read_all(b.infill(Request(messages=({"role": "user", "content": "hi"},))))
        == "return a + b\n"
    )
    assert fake.requests[-1][0] == "/v1/chat/completions"


def test_one_pooled_connection_for_many_requests(fake, backends):
    b = backends(OpenAIBackend, fake.url, model="m")
    for _ in range(6):
        assert read_all(b.infill(Request(prefix="p", suffix="s"))) == "return a + b\n"
    assert fake.connections == 1


def test_cancel_closes_the_stream_and_the_server_stops(fake, backends):
    fake.mode = "endless"
    b = backends(OllamaBackend, fake.url)
    s = b.infill(Request(prefix="p", suffix="s", max_tokens=100000))
    got = 0
    for c in s:
        got += bool(c.text)
        if got == 5:
            s.cancel()
    assert s.finish_reason == "cancelled"
    assert fake.stopped.wait(10), "the server kept generating after the cancel"
    assert fake.written[-1] < 100000
    st = b.status()
    assert st["cancelled"] == 1 and st["wasted_tokens"] >= 5 and st["health"]["ok"]
    # the next request works (a fresh connection; the cancelled one was closed)
    fake.mode = "ok"
    assert read_all(b.infill(Request(prefix="p", suffix="s"))) == "return a + b\n"


def test_waiting_stream_hands_back_empty_chunks(fake, backends):
    """A backend that is slow to answer must not hold the reading thread: next() returns "" ."""
    fake.mode = "hang"
    b = backends(OllamaBackend, fake.url)
    s = b.infill(Request(prefix="p", suffix="s"))
    assert next(s).text == "" and next(s).text == ""
    s.cancel()
    assert list(s) == [] and s.finish_reason == "cancelled"


def test_timeout_is_an_error(fake, backends):
    fake.mode = "hang"
    b = backends(OllamaBackend, fake.url, timeout_s=0.3)
    with pytest.raises(BackendError, match="did not answer within 0.3 s"):
        read_all(b.infill(Request(prefix="p", suffix="s")))


def test_server_error_is_reported_then_backs_off(fake, backends):
    fake.mode = "error"
    b = backends(OllamaBackend, fake.url)
    with pytest.raises(BackendError, match="HTTP 500: model runner has unexpectedly stopped"):
        read_all(b.infill(Request(prefix="p", suffix="s")))
    sent = len(fake.requests)
    with pytest.raises(BackendUnavailable, match="next try in"):
        b.infill(Request(prefix="p", suffix="s"))
    assert len(fake.requests) == sent  # no retry storm: nothing was sent
    st = b.status()
    assert st["failed"] == 1 and not st["health"]["ok"] and "HTTP 500" in st["health"]["last_error"]


def test_garbage_reply_is_an_error(fake, backends):
    fake.mode = "garbage"
    b = backends(OpenAIBackend, fake.url, model="m")
    with pytest.raises(BackendError, match="cannot read"):
        read_all(b.infill(Request(prefix="p", suffix="s")))


def test_unreachable_server(backends):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    b = backends(LlamaCppBackend, f"http://127.0.0.1:{port}")
    with pytest.raises(BackendError, match="unreachable"):
        read_all(b.infill(Request(prefix="p", suffix="s")))


def test_health_backoff_doubles_up_to_the_cap():
    now = [0.0]
    h = Health(base_s=0.5, cap_s=4.0, clock=lambda: now[0])
    delays = []
    for i in range(6):
        first = h.failed("down")
        assert first == (i == 0)
        delays.append(h.delay())
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    now[0] = 10.0
    assert h.delay() == 0 and h.succeeded() and h.ok and not h.succeeded()


def test_api_key_from_env_is_sent_and_never_shown(fake, backends, monkeypatch, tmp_path):
    from spark_lsp.backends import make_remote
    from spark_lsp.settings import Settings

    monkeypatch.setenv("SPARK_TEST_KEY", "sk-secret-123")
    b = make_remote(
        Settings(
            backend="openai",
            backend_url=fake.url,
            backend_model="m",
            backend_api_key_env="SPARK_TEST_KEY",
        )
    )
    try:
        read_all(b.infill(Request(prefix="p", suffix="s")))
        assert fake.headers[-1]["Authorization"] == "Bearer sk-secret-123"
        fake.mode = "error"
        with pytest.raises(BackendError) as err:
            read_all(b.infill(Request(prefix="p", suffix="s")))
        assert "sk-secret" not in repr(b) + str(b.status()) + str(err.value)
    finally:
        b.close()
    keyfile = tmp_path / "key"
    keyfile.write_text("sk-from-file\n")
    b = make_remote(
        Settings(
            backend="ollama",
            backend_url=fake.url,
            backend_model="m",
            backend_api_key_file=str(keyfile),
        )
    )
    try:
        fake.mode = "ok"
        read_all(b.infill(Request(prefix="p", suffix="s")))
        assert fake.headers[-1]["Authorization"] == "Bearer sk-from-file"
    finally:
        b.close()
    monkeypatch.delenv("SPARK_TEST_KEY")
    with pytest.raises(BackendError, match="SPARK_TEST_KEY.*not set"):
        make_remote(Settings(backend="openai", backend_api_key_env="SPARK_TEST_KEY"))
    with pytest.raises(BackendError, match="cannot read the API key file"):
        make_remote(Settings(backend="openai", backend_api_key_file=str(tmp_path / "missing")))


def test_model_seam_generate_follows_the_cancel_token(fake, backends):
    """As the services call it: generate(ids, params, slot, cancel=token, text=TextPrompt)."""
    from engine import GenerationParams
    from engine.cancel import CancelToken
    from spark_lsp.backends import TextPrompt

    fake.mode = "endless"
    b = backends(OllamaBackend, fake.url)
    token = CancelToken()
    s = b.generate(
        [1, 2, 3],
        GenerationParams(max_new_tokens=100000, temperature=0.0),
        "doc",
        cancel=token,
        text=TextPrompt("def f(", ")\n"),
    )
    body = fake.requests and fake.requests[-1][1]
    got = 0
    for c in s:
        got += bool(c.text)
        if got == 3:
            token.cancel("user typed")
    body = fake.requests[-1][1]
    assert (
        body["prompt"] == "def f("
        and body["suffix"] == ")\n"
        and body["options"]["num_predict"] == 100000
    )
    assert s.finish_reason == "cancelled" and fake.stopped.wait(10)
    with pytest.raises(BackendError, match="TextPrompt"):
        b.generate([1], GenerationParams(), "doc", cancel=CancelToken())


def test_templates_render_each_family_and_custom_layouts():
    from spark_lsp.backends import templates

    assert templates.family_of("qwen2.5-coder:7b-base") == "qwen"
    assert templates.family_of("deepseek-ai/deepseek-coder-6.7b-base") == "deepseek"
    assert templates.family_of("TheBloke/CodeLlama-7B-GGUF") == "codellama"
    assert templates.family_of("llama3") is None and templates.resolve("auto", "llama3") is None
    assert (
        templates.resolve(None, "my-model", "deepseek").name == "deepseek"
    )  # the fimFormat setting
    from engine.fim import STYLES

    star = templates.resolve("starcoder", None)  # engine.fim's layout, not a copy of it
    assert star.render("P", "S", (FileChunk("a.py", "A"),), "b.py") == STYLES["starcoder"].render(
        "P", "S", files=[("a.py", "A")], repo="workspace", path="b.py"
    )
    assert templates.resolve("codellama", None).render("P", "S") == "<PRE> P <SUF>S <MID>"
    custom = templates.resolve("<A>{prefix}<B>{suffix}<C>", None)
    assert custom.render("x = {1}", "{suffix}") == "<A>x = {1}<B>{suffix}<C>"  # braces in code stay
    with pytest.raises(ValueError, match=r"\{prefix\} and \{suffix\}"):
        templates.resolve("<A>{prefix}", None)


def test_remote_settings_are_checked(fake):
    from spark_lsp.backends import make_remote
    from spark_lsp.settings import Settings, SettingsError, update

    s, _ = update(
        Settings(),
        {
            "backend": "ollama",
            "backendUrl": fake.url,
            "backendModel": "m",
            "backendTimeoutS": 2,
            "fimTemplate": "qwen",
        },
    )
    assert (s.backend, s.backend_url, s.backend_model, s.backend_timeout_s, s.fim_template) == (
        "ollama",
        fake.url,
        "m",
        2.0,
        "qwen",
    )
    with pytest.raises(SettingsError, match="backend"):
        update(Settings(), {"backend": "vllm"})
    with pytest.raises(BackendError, match="backendUrl"):
        make_remote(Settings(backend="openai", backend_url="localhost:8000"))
    with pytest.raises(BackendError, match="fimTemplate"):
        make_remote(Settings(backend="openai", fim_template="<PRE>{prefix}"))
