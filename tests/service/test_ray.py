"""The engine service on a real local Ray cluster with 2 engine replicas (Ray Serve), served
over TLS (``wss://``, a throwaway CA's certificate made with ``trustme``): Serve's proxy cannot
change its options once started, so one cluster serves every test here the way ``--ray
--tls-cert`` does; without the certificate the same deployment serves ``ws://``."""

import asyncio
import functools
import os
import signal
import socket
import time

import pytest
import trustme
from service_support import editor_client

ray = pytest.importorskip(
    "ray", reason="the Ray test needs the 'ray' extra (part of the test extra)"
)

from engine import GenerationParams  # noqa: E402
from engine.models import default_model_dir  # noqa: E402
from engine.service import protocol as P  # noqa: E402
from engine.service import ray_app, ray_replica  # noqa: E402
from engine.service.client import EngineClient  # noqa: E402
from engine.service.client_core import EngineUnavailable  # noqa: E402
from engine.service.launch import DaemonError  # noqa: E402
from engine.service.model_files import files_digest  # noqa: E402
from engine.service.sync_client import SyncEngineClient  # noqa: E402
from engine.source import open_model  # noqa: E402

pytestmark = pytest.mark.slow


start_editor = editor_client().start_editor
TOKEN = "ray-test-token-" + "x" * 20
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    """A throwaway CA's certificate (PEM file) and the certificate and key it signs for
    127.0.0.1, which Serve's proxy serves."""
    d = tmp_path_factory.mktemp("ray-tls")
    authority = trustme.CA()
    leaf = authority.issue_cert("localhost", "127.0.0.1")
    out = {k: str(d / f"{k}.pem") for k in ("ca", "cert", "key")}
    authority.cert_pem.write_to_path(out["ca"])
    leaf.cert_chain_pems[0].write_to_path(out["cert"])
    leaf.private_key_pem.write_to_path(out["key"])
    return out


@pytest.fixture(scope="module")
def url(ca):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield ray_app.deploy(
            str(default_model_dir()),
            port=port,
            replicas=2,
            token=TOKEN,
            num_cpus=0.5,
            tls_cert=ca["cert"],
            tls_key=ca["key"],
        )
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def connect(ca):
    """``EngineClient.connect`` trusting the test CA."""
    return functools.partial(EngineClient.connect, cafile=ca["ca"])


async def early_stats(gen) -> dict:
    """Read ``gen`` to its end; the stats it had with its first piece (its first tokens
    message's)."""
    early = None
    async for _ in gen:
        if early is None:
            early = dict(gen.stats)
    return early


def run(coro):
    return asyncio.run(coro)


def test_wrong_token_is_refused_and_tls_is_checked(url, connect):
    assert url.startswith("wss://127.0.0.1:")
    with pytest.raises(EngineUnavailable, match="HTTP 403"):
        run(connect(url, "wrong-wrong-wrong-wrong"))
    with pytest.raises(EngineUnavailable, match="could not be verified"):
        run(EngineClient.connect(url, TOKEN))  # without the CA
    # Serve's proxy keeps its options: a deployment without TLS is refused, not announced ws://
    with pytest.raises(DaemonError, match="already runs on this cluster with TLS"):
        ray_app.deploy(
            str(default_model_dir()), port=int(url.rsplit(":", 1)[1].strip("/")), token=TOKEN
        )


def test_clients_move_to_the_ingress_replicas_own_socket(url, connect, ca):
    """The hello of a connection through Serve's proxy names the ingress replica's own endpoint;
    clients move there (same token, origins, TLS) unless told not to, and generate the same."""

    async def scenario():
        moved = await connect(url, TOKEN)
        stay = await connect(url, TOKEN, direct=False)
        try:
            offered = stay.hello["capabilities"].get("direct")
            assert moved.url != url and moved.url.startswith("wss://127.0.0.1:"), moved.url
            assert stay.url == url and offered and offered.startswith("wss://127.0.0.1:")
            assert "direct" not in moved.hello["capabilities"]  # nothing further to move to
            params = GenerationParams(max_new_tokens=6, ignore_eos=True)
            gens = [await (await c.generate(PROMPT, params)).wait() for c in (moved, stay)]
            assert [g.finish_reason for g in gens] == ["length"] * 2, [g.error for g in gens]
            assert gens[0].text == gens[1].text and gens[0].tokens
            with pytest.raises(EngineUnavailable, match="HTTP 401"):
                await connect(moved.url, "wrong-wrong-wrong-wrong")
            with pytest.raises(EngineUnavailable, match="HTTP 403"):
                await connect(moved.url, TOKEN, origin="https://evil.example")
            with pytest.raises(EngineUnavailable, match="HTTP 403"):
                await connect(url, TOKEN, origin="https://evil.example")
            with pytest.raises(EngineUnavailable, match="could not be verified"):
                await EngineClient.connect(moved.url, TOKEN)  # the same certificate: the CA
        finally:
            await moved.close()
            await stay.close()

    run(scenario())
    sync = SyncEngineClient.open(url, TOKEN, cafile=ca["ca"])  # the language server's client
    try:
        assert sync.url != url
        params = GenerationParams(max_new_tokens=6, ignore_eos=True)
        gen = sync.generate(PROMPT, params, slot="sync")
        assert gen.result() and gen.finish_reason == "length"
    finally:
        sync.close()


async def test_the_language_server_generates_on_an_ingress_replicas_own_socket(
    url, ca, monkeypatch, tmp_path
):
    """A real `spark-lsp serve` with `engine` set to the deployment's URL (its token and CA from
    the environment, as a user without a record gives them) and no model of its own moves to an
    ingress replica's own socket, takes the model's tokenizer from the ingress, and suggests what
    an in-process engine of the same precision suggests."""
    monkeypatch.setenv("SPARK_LSP_ENGINE_TOKEN", TOKEN)
    monkeypatch.setenv("SPARK_LSP_ENGINE_CA", ca["ca"])
    model = default_model_dir()
    sample = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    "
    uri = "file:///work/ray_sample.py"

    async def suggest(settings, model=model):
        client, ed = await start_editor(model, {**settings, "maxTokens": 12})
        try:
            ed.open(uri, sample)
            res = await ed.inline(uri, len(sample))
            status = await ed.command("spark.status")
            return [i.insert_text for i in res.items], status
        finally:
            await client.shutdown_session()
            await client.stop()

    local, _ = await suggest({"precision": "fp32"})  # the replicas' precision
    monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path / "cache"))
    remote, status = await suggest({"engine": url}, model=None)
    [served] = (tmp_path / "cache" / "served").iterdir()
    assert (served / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    assert remote == local and remote, (remote, local)
    where = status["engine"]["engine"]
    assert where != url and where.startswith("wss://127.0.0.1:"), status["engine"]
    assert status["engine"]["target"] == url  # what the setting said


def test_slot_affinity_keeps_each_document_on_one_replica(url, connect):
    async def scenario():
        c = await connect(url, TOKEN)
        try:
            seen: dict[str, set[str]] = {}
            reused = []
            for round_ in range(3):
                gens = [
                    await c.generate(
                        f"# doc {d}\n{PROMPT}" + "    x = 1\n" * round_,
                        GenerationParams(max_new_tokens=4),
                        slot=f"doc{d}",
                    )
                    for d in range(12)
                ]
                for d, g in enumerate(gens):
                    await g.wait()
                    assert g.finish_reason in ("length", "eos"), g.error
                    seen.setdefault(f"doc{d}", set()).add(g.stats["replica"])
                    if round_:
                        reused.append(g.stats["reused_tokens"] / g.stats["prompt_tokens"])
            return seen, reused, await c.status()
        finally:
            await c.close()

    seen, reused, status = run(scenario())
    # the generations went over this ingress replica's connections to both replicas' sockets
    assert status["models"][0]["sockets"] == 2, status
    assert all(len(replicas) == 1 for replicas in seen.values()), seen  # each document stays put
    assert len(set().union(*seen.values())) == 2  # and both replicas get documents
    assert min(reused) > 0.5  # the KV prefix of the earlier round was there


def test_two_ingress_replicas_placing_at_once_split_documents_evenly(url, connect):
    """Clients on both ingress replicas open documents at once, all hashing to the same shard:
    the placement reads and claims the replicas' own counts, so the replicas' loads stay within
    one of each other (each ingress counting only its own left them 2 apart)."""
    from engine.service import placement

    keys = (f"even-{os.getpid()}-{i}" for i in range(10_000))
    docs = [k for k in keys if placement.rank_shards(k, 2)[0] == 0][:6]

    async def scenario():
        clients: dict[str, EngineClient] = {}
        for _ in range(40):  # Serve's proxy spreads connections over the ingress replicas
            c = await connect(url, TOKEN)
            if c.url in clients or len(clients) == 2:
                await c.close()
            else:
                clients[c.url] = c
            if len(clients) == 2:
                break
        try:
            assert len(clients) == 2, "Serve's proxy sent every connection to one ingress replica"
            a, b = clients.values()
            params = GenerationParams(max_new_tokens=2)
            gens = await asyncio.gather(
                *(c.generate(PROMPT, params, slot=d) for c, d in zip([a, b] * 3, docs))
            )
            for g in gens:
                await g.wait()
                assert g.finish_reason in ("length", "eos"), g.error
            return [g.stats["replica"] for g in gens]
        finally:
            for c in clients.values():
                await c.close()

    replicas = run(scenario())
    from ray import serve

    loads = [
        serve.get_deployment_handle(f"EngineShard{i}", ray_app.APP_NAME).load.remote().result()
        for i in (0, 1)
    ]
    assert abs(loads[0] - loads[1]) <= 1, loads  # every document of the module's tests too
    # these six spread with the module's earlier documents: 3 and 3, or 2 and 4 where the
    # earlier ones left one replica a document ahead
    assert min(replicas.count(r) for r in set(replicas)) >= 2 and len(set(replicas)) == 2


def test_a_killed_replica_loses_nothing_but_the_cache(url, connect):
    """Its generation continues on the other replica; the first tokens of a generation carry
    its early stats (as the daemon's do), and a restarted one's ``done`` repeats those."""

    async def scenario():
        c = await connect(url, TOKEN)
        try:
            params = GenerationParams(max_new_tokens=300, ignore_eos=True)
            ref = await c.generate(PROMPT, params, slot="victim")
            ref_early = await early_stats(ref)
            victim = int(ref.stats["replica"].rsplit(":", 1)[1])
            gen = await c.generate(PROMPT, params, slot="victim")
            others = [
                await c.generate(PROMPT, GenerationParams(max_new_tokens=40), slot=f"o{i}")
                for i in range(4)
            ]
            n = 0
            async for _piece in gen:
                n += 1
                if n == 1:
                    early = dict(gen.stats)
                if n == 3:
                    os.kill(victim, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*(g.wait() for g in others)), 120)
            after = await (
                await c.generate(PROMPT, GenerationParams(max_new_tokens=8), slot="victim")
            ).wait()
            return ref, ref_early, gen, early, others, after, victim
        finally:
            await c.close()

    ref, ref_early, gen, early, others, after, victim = run(scenario())
    assert set(ref_early) == set(P.EARLY_STATS) and ref_early["ttft_ms"] > 0
    assert {k: ref.stats[k] for k in P.EARLY_STATS} == ref_early
    assert gen.finish_reason == "length" and gen.text == ref.text  # continued on the other replica
    assert gen.stats.get("restarts", 0) >= 1 and not gen.stats["replica"].endswith(f":{victim}")
    # its first tokens came from the victim, which held the prompt: the done says the same
    assert early["prompt_tokens"] == ref_early["prompt_tokens"]
    assert early["reused_tokens"] == early["prompt_tokens"] - 1
    assert {k: gen.stats[k] for k in P.EARLY_STATS} == early
    assert all(g.finish_reason in ("length", "eos") for g in others)  # none lost or hung
    assert after.finish_reason in ("length", "eos")


def test_replicas_load_engines_that_do_not_spin_like_the_daemon():
    """A replica serves its socket as the daemon does: its ONNX Runtime threads do not spin
    between steps (the daemon's default)."""
    from engine.service.daemon import load_engines

    replica = ray_replica.EngineReplica.func_or_class(str(default_model_dir()), threads=1, slots=2)
    try:
        (daemon_engine,) = load_engines([default_model_dir()], slots=2, threads=1)
        for eng in (replica.engine, daemon_engine):
            rt = eng.runtime
            assert not any(t.spinning for t in (rt.wide, rt.busy, rt.calm))
    finally:
        replica.pool.shutdown()


def test_a_replica_serves_its_socket_and_serve_alike():
    """A replica opens its socket only with a token and ``direct``; the generations on it count
    in the replica's load as ``generate``'s do (the ingress's other way in, where there is no
    socket), and both give the same tokens for the same prompt and document."""
    model = str(default_model_dir())
    bare = ray_replica.EngineReplica.func_or_class(model, threads=1, slots=2)
    assert bare.server is None and bare.describe()["socket"] is None
    bare.pool.shutdown()
    replica = ray_replica.EngineReplica.func_or_class(
        model, threads=1, slots=4, token=TOKEN, direct={"host": "127.0.0.1", "driver_ip": None}
    )
    params = GenerationParams(max_new_tokens=6, ignore_eos=True)

    async def scenario():
        items = [
            item
            async for item in replica.generate(
                {"prompt": list(range(1, 9)), "params": P.params_to_json(params), "slot": "a"}
            )
        ]
        url = replica.describe()["socket"]
        c = await EngineClient.connect(url, TOKEN, direct=False)
        try:
            gen = await (await c.generate(list(range(1, 9)), params, slot="b")).wait()
        finally:
            await c.close()
        return items, url, gen, await replica.load()

    try:
        items, url, gen, load = run(scenario())
    finally:
        replica.__del__()
        replica.pool.shutdown()
    assert url.startswith("ws://127.0.0.1:")
    served = [t for item in items if "tokens" in item for t, _ in item["tokens"]]
    assert items[0]["stats"]["prompt_tokens"] == 8 and items[-1]["done"] == "length"
    assert gen.finish_reason == "length" and gen.tokens == served
    assert load == 2  # documents "a" (through generate) and "b" (through the socket)
    assert replica.server is None  # closed when Serve stops the replica


def in_process_tokens(model, params) -> list[int]:
    """The tokens the in-process engine generates for PROMPT."""
    from engine import Engine

    gen = Engine.load(model).generate(PROMPT, params)
    for _ in gen:  # generates while it is read
        pass
    return list(gen.tokens)


def one_generation(model: str, name: str, url, connect, ca, params):
    """Deploy ``model`` as a one-replica application ``name`` beside the module's, generate
    PROMPT on it once, delete it: (hello's models, the tokens, the model_files answer)."""
    from urllib.parse import urlsplit

    from ray import serve

    app_url = ray_app.deploy(
        model,
        port=urlsplit(url).port,
        replicas=1,
        token=TOKEN,
        num_cpus=0.25,
        tls_cert=ca["cert"],
        tls_key=ca["key"],
        name=name,
        route_prefix=f"/{name}",
    )

    async def scenario():
        c = await connect(app_url, TOKEN)
        try:
            gen = await (await c.generate(PROMPT, params, slot=name)).wait()
            return c.hello["models"], gen.tokens, await c.model_files()
        finally:
            await c.close()

    try:
        return run(scenario())
    finally:
        serve.delete(name)


def test_a_gguf_model_deploys_and_generates_what_it_does_in_process(url, connect, ca, tmp_path):
    """`engine serve --ray --model FILE.gguf`: the ingress reads the file's tokenizer, the
    replica loads the file, and the tokens are the in-process engine's for that file."""
    from gguf_files import write_gguf

    gguf = write_gguf(default_model_dir(), tmp_path / "mini-q8_0.gguf", qtype="Q8_0")
    params = GenerationParams(max_new_tokens=12, ignore_eos=True)
    want = in_process_tokens(gguf, params)
    models, got, (closing, files) = one_generation(str(gguf), "gguf", url, connect, ca, params)
    assert [m["name"] for m in models] == ["mini-q8_0"]
    assert got == want
    # the ingress sends the tokenizer it made from the file's header, named as hello named it
    assert closing["digest"] == models[0]["files"] == files_digest(files)
    folder = tmp_path / "served"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    assert open_model(folder).tokenizer.encode(PROMPT) == open_model(gguf).tokenizer.encode(PROMPT)


def test_a_hub_model_is_downloaded_by_each_replica_on_its_node(
    url, connect, ca, tmp_path, monkeypatch
):
    """`engine serve --ray --model hf:ORG/REPO`: the command resolves the model without its
    weights (the record's folder) and deploys it pinned to that commit; the replicas download
    the weights where they run (on a cluster: each node into its own cache, with the command's
    Hub settings), and generate what the in-process engine does."""
    from fake_hub import FakeHub

    model = default_model_dir()
    params = GenerationParams(max_new_tokens=12, ignore_eos=True)
    want = in_process_tokens(model, params)
    with FakeHub() as hub:
        commit = hub.add_folder("test-org/mini", model)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        folders, spec = ray_app.model_source(["hf:test-org/mini"])
        assert spec == f"hf:test-org/mini@{commit}"
        assert not list(folders[0].glob("*.safetensors"))  # the command fetched no weights
        models, got, _ = one_generation(spec, "hub", url, connect, ca, params)
        weights = [p for m, p, _ in hub.requests if m == "GET" and p.endswith(".safetensors")]
    assert [m["name"] for m in models] == ["mini"] and got == want
    assert weights and all(f"/resolve/{commit}/" in p for p in weights), weights
    assert list(folders[0].glob("*.safetensors"))  # where the replica ran: this machine


def test_direct_endpoints_listen_only_where_clients_can_reach_them():
    here = ray.util.get_node_ip_address()
    assert ray_replica.direct_bind(None, here) is None  # --no-direct
    assert ray_replica.direct_bind("127.0.0.1", here) == "127.0.0.1"  # the driver's own node
    assert ray_replica.direct_bind("::1", here) == "::1"
    assert ray_replica.direct_bind("127.0.0.1", "198.51.100.7") is None  # another node's loopback
    assert ray_replica.direct_bind("0.0.0.0", "198.51.100.7") == here  # the node's own address


def test_no_direct_is_an_engine_serve_option():
    from spark_lsp.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["engine", "serve", "--ray"]).direct is True
    assert parse(["engine", "serve", "--ray", "--no-direct"]).direct is False


def test_the_server_reconnects_through_the_proxy_when_its_ingress_replica_dies(
    url, ca, monkeypatch
):
    """Every ingress replica killed: the language server's model (``engine_ws``) fails the
    request in flight, says so once, and on a later request reaches a new ingress replica through
    the proxy and moves to its own socket."""
    from engine.cancel import CancelToken
    from spark_lsp.backends import engine_ws
    from spark_lsp.backends.base import BackendError

    monkeypatch.setenv(engine_ws.TOKEN_ENV, TOKEN)
    monkeypatch.setenv(engine_ws.CA_ENV, ca["ca"])
    model = engine_ws.EngineServiceModel(url, str(default_model_dir()))
    health = []
    model.on_health = lambda up, message: health.append(up)
    ids = model.tokenizer.encode(PROMPT)
    params = GenerationParams(max_new_tokens=8, ignore_eos=True)

    def suggest() -> str:
        return "".join(c.text for c in model.generate(ids, params, "doc", cancel=CancelToken()))

    try:
        first, before = suggest(), model.url
        assert before != url
        ingresses = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if "#EngineIngress#" in a["name"]
        ]
        assert len(ingresses) == 2
        # a long generation in flight when they die (ray.kill returns at once; a short one
        # could still be answered, and one started after the connection closed reconnects
        # without a word)
        long = GenerationParams(max_new_tokens=1900, ignore_eos=True)
        in_flight = iter(model.generate(ids, long, "doc", cancel=CancelToken()))
        next(in_flight)
        for name in ingresses:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        with pytest.raises(BackendError):
            for _ in in_flight:
                pass
        answers = []
        for _ in range(60):  # Serve starts new ingress replicas; the proxy routes to them
            try:
                answers.append(suggest())
            except BackendError as exc:
                answers.append(exc)
            if answers[-1] == first:
                break
            time.sleep(1.0)
        assert answers[-1] == first, answers
        # on a new ingress replica's own socket (which may have drawn the old one's port)
        assert model.url != url and model.url.startswith("wss://127.0.0.1:")
        # Serve brings both ingress replicas back (new ones), which the next test connects to
        for _ in range(240):
            now = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if "#EngineIngress#" in a["name"]
            ]
            if len(now) == 2:
                break
            time.sleep(0.5)
        assert len(now) == 2 and not set(now) & set(ingresses), (now, ingresses)
        assert health == [False, True]  # told once it was lost, once it answered again
    finally:
        model.close()


def test_a_stopping_ingress_ends_its_direct_clients_generations_cleanly(url, connect):
    """Serve stops the application (last in this module: it deletes the deployment): a client
    on an ingress replica's own socket gets its generation's ``done`` (cancelled) before the
    socket closes, not a dropped connection."""
    from ray import serve

    async def scenario():
        c = await connect(url, TOKEN)
        assert c.url != url
        params = GenerationParams(max_new_tokens=1900, ignore_eos=True)
        gen = await c.generate(PROMPT * 8, params, slot="stopping")
        # more of them at once on the replicas, so that this one lasts until Serve stops it
        # (alone, the bundled model may write its 1,900 tokens before)
        for i in range(7):
            await c.generate(PROMPT * 8, params, slot=f"stopping-{i}")
        n = 0
        async for _piece in gen:
            n += 1
            if n == 3:
                stopping = asyncio.ensure_future(asyncio.to_thread(serve.delete, ray_app.APP_NAME))
        await asyncio.wait_for(stopping, 120)
        await c.close()
        return gen

    gen = run(scenario())
    assert gen.finish_reason == "cancelled", (gen.finish_reason, gen.error)
    assert 3 <= gen.stats["new_tokens"] < 1900
