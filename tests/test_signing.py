"""Settings signatures: Ed25519 by the coordinator's private key, verified against the nodes'
trusted public keys by key id. The codec and the key files, the ``keys`` commands, a rogue
process that holds only the public key against real agent processes, and a key rotation in
the middle of a tuning by a real coordinator process."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiomqtt
import orjson
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client.parser import text_string_to_metric_families
from test_resume import (
    coordinator_config,
    entries,
    final_applied,
    mid_trial,
    start,
    wait_until,
)

from hyperagent import bus
from hyperagent.demo import JOB, simulated_cluster
from hyperagent.job import JobReporter
from hyperagent.signing import (
    KeyFileError,
    SigningKey,
    TrustedKeys,
    key_id,
    load_public_key,
    load_signing_key,
    write_key_pair,
)

from conftest import REPO, Mosquitto, free_port, wait_for_port

pytestmark = pytest.mark.timeout(240)

KEY = SigningKey.generate()
MESSAGE = {
    "job": "j",
    "version": 3,
    "trial": 1,
    "nodes": ["n0", "n1"],
    "settings": {"bucket_mb": 8, "power_cap_w": 150},
    "backend": {"NCCL_BUFFSIZE": "8388608"},
    "plan": None,
    "issued_at": 1796400000.25,
}


def cli(*argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hyperagent.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


# -- the codec ---------------------------------------------------------------------------


def test_a_signature_names_its_key_and_covers_every_field() -> None:
    trusted = KEY.trusted()
    signed = bus.sign(MESSAGE, KEY)
    raw = KEY.public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert signed["key_id"] == KEY.key_id == hashlib.sha256(raw).hexdigest()[:16]
    assert len(bytes.fromhex(signed["signature"])) == 64
    assert bus.signature_problem(signed, trusted) is None
    assert bus.verify(orjson.loads(bus.encode(signed)), trusted)  # survives the wire
    assert bus.sign(signed, KEY) == signed  # signing again replaces the signature
    tampered = {
        "job": "other",
        "version": 4,
        "trial": 2,
        "nodes": ["n0"],
        "settings": {"bucket_mb": 8, "power_cap_w": 100},
        "backend": {},
        "plan": {"settle_steps": 1},
        "issued_at": 1796400000.5,
        "schema": 2,
    }
    for field, value in tampered.items():
        problem = bus.signature_problem({**signed, field: value}, trusted)
        assert problem is not None and problem[0] == "bad_signature", field
    extra = bus.signature_problem({**signed, "power_cap_w": 100}, trusted)
    assert extra is not None and extra[0] == "bad_signature"  # an added field too


def test_missing_malformed_and_foreign_signatures_say_why() -> None:
    trusted = KEY.trusted()
    signed = bus.sign(MESSAGE, KEY)
    other = SigningKey.generate()

    def reason(message: dict[str, Any]) -> str | None:
        problem = bus.signature_problem(message, trusted)
        return problem[0] if problem else None

    assert reason({k: v for k, v in signed.items() if k != "signature"}) == "unsigned"
    assert reason({k: v for k, v in signed.items() if k != "key_id"}) == "unsigned"
    assert reason({**signed, "signature": "zz" * 64}) == "unsigned"
    assert reason({**signed, "signature": signed["signature"][:64]}) == "unsigned"
    assert reason({**signed, "signature": 7}) == "unsigned"
    legacy = {**MESSAGE, "schema": 1, "hmac": "00" * 32}
    assert bus.signature_problem(legacy, trusted) == (
        "unsigned",
        "an HMAC, no Ed25519 signature (a coordinator of an older version?)",
    )
    foreign = bus.sign(MESSAGE, other)
    problem = bus.signature_problem(foreign, trusted)
    assert problem is not None and problem[0] == "unknown_key"
    assert other.key_id in problem[1] and KEY.key_id in problem[1]  # which, and what is trusted
    # another key's signature under the trusted key's id, and the trusted id on a message
    # signed by a second trusted key
    assert reason({**foreign, "key_id": KEY.key_id}) == "bad_signature"
    both = TrustedKeys([KEY.public, other.public])
    assert bus.verify(foreign, both) and bus.verify(signed, both)
    assert not bus.verify({**foreign, "key_id": KEY.key_id}, both)
    assert reason({**signed, "key_id": "0" * 16}) == "unknown_key"


# -- key files ---------------------------------------------------------------------------


def test_key_files_are_checked_for_kind_and_mode(tmp_path: Path) -> None:
    key, private, public = write_key_pair(tmp_path, "settings")
    assert private.stat().st_mode & 0o777 == 0o600 and public.stat().st_mode & 0o777 == 0o644
    assert load_signing_key(private).key_id == key.key_id
    assert key_id(load_public_key(public)) == key.key_id
    with pytest.raises(KeyFileError, match="holds a public key"):
        load_signing_key(public)
    with pytest.raises(KeyFileError, match="holds a private key: a node must hold only"):
        load_public_key(private)
    private.chmod(0o604)
    with pytest.raises(KeyFileError, match="accessible to other users"):
        load_signing_key(private)
    public.chmod(0o666)
    with pytest.raises(KeyFileError, match="writable by other users"):
        load_public_key(public)
    with pytest.raises(KeyFileError, match="No such file"):
        load_public_key(tmp_path / "absent.pub")
    with pytest.raises(KeyFileError, match="exists"):
        write_key_pair(tmp_path, "settings")
    ec_key = tmp_path / "ec.key"
    ec_key.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    ec_key.chmod(0o600)
    with pytest.raises(KeyFileError, match="not an Ed25519 key"):
        load_signing_key(ec_key)
    garbage = tmp_path / "garbage.key"
    garbage.write_text("-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")
    garbage.chmod(0o600)
    with pytest.raises(KeyFileError, match="not a PEM private key"):
        load_signing_key(garbage)


def test_a_key_added_counts_for_every_check_that_reads_the_files_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two agents' checks (threads) refresh one set while the new key's file is read slowly:
    the one that finds the files unchanged waits for that read instead of answering from the
    old set (an unknown key for a message signed by the new one)."""
    from concurrent.futures import ThreadPoolExecutor

    from hyperagent import signing

    trusted_dir = tmp_path / "trusted"
    trusted_dir.mkdir(mode=0o755)
    _, _, old_pub = write_key_pair(tmp_path / "keys", "old")
    new, _, new_pub = write_key_pair(tmp_path / "keys", "new")
    shutil.copy(old_pub, trusted_dir / "old.pub")
    trusted = TrustedKeys(paths=[trusted_dir])
    read = signing._read_public_keys

    def slow_read(paths: Any) -> Any:
        time.sleep(0.3)
        return read(paths)

    monkeypatch.setattr(signing, "_read_public_keys", slow_read)
    shutil.copy(new_pub, trusted_dir / "new.pub")

    def check(delay: float) -> bool:
        time.sleep(delay)
        trusted.refresh()
        return new.key_id in trusted

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(check, (0.0, 0.1))) == [True, True]


def test_a_trusted_directory_is_read_again_when_a_key_is_added(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    trusted_dir = tmp_path / "trusted"
    trusted_dir.mkdir(mode=0o755)
    old, _, old_pub = write_key_pair(keys, "old")
    new, _, new_pub = write_key_pair(keys, "new")
    shutil.copy(old_pub, trusted_dir / "old.pub")
    (trusted_dir / "README").write_text("not a key: ignored\n")
    trusted = TrustedKeys(paths=[trusted_dir])
    assert trusted.ids == [old.key_id]
    assert not trusted.refresh()  # nothing changed: a few stat calls
    shutil.copy(new_pub, trusted_dir / "new.pub")
    assert trusted.refresh() and set(trusted.ids) == {old.key_id, new.key_id}
    (trusted_dir / "bad.pub").write_text("garbage")
    assert not trusted.refresh() and len(trusted) == 2  # lenient at run time: kept
    (trusted_dir / "bad.pub").unlink()
    (trusted_dir / "old.pub").unlink()  # the end of a rotation: the old key refused again
    assert trusted.refresh() and trusted.ids == [new.key_id]
    assert not bus.verify(bus.sign(MESSAGE, old), trusted)
    listed = TrustedKeys(paths=[old_pub, new_pub])  # two files, as during a rotation
    assert set(listed.ids) == {old.key_id, new.key_id}
    trusted_dir.chmod(0o775)
    with pytest.raises(KeyFileError, match="directory writable by other users"):
        TrustedKeys(paths=[trusted_dir])


# -- the commands ------------------------------------------------------------------------


def test_keys_generate_and_id(tmp_path: Path) -> None:
    made = cli("keys", "generate", "--out", str(tmp_path / "k"), "--name", "coord")
    assert made.returncode == 0, made.stderr
    kid = made.stdout.split()[2]
    assert len(kid) == 16 and "the private key (0600)" in made.stdout
    private, public = tmp_path / "k" / "coord.key", tmp_path / "k" / "coord.pub"
    ids = cli("keys", "id", str(public), str(private))
    assert ids.returncode == 0
    assert ids.stdout.splitlines() == [f"{kid}  {public}", f"{kid}  {private}  (private key)"]
    again = cli("keys", "generate", "--out", str(tmp_path / "k"), "--name", "coord")
    assert again.returncode == 1 and "exists; give another --name" in again.stderr
    missing = cli("keys", "id", str(tmp_path / "absent.pub"))
    assert missing.returncode == 1 and "absent.pub: No such file" in missing.stderr
    group = cli("keys", "generate", "--out", str(tmp_path / "g"), "--group", "no-such-group-x")
    assert group.returncode == 1 and "no group 'no-such-group-x'" in group.stderr


def test_the_coordinator_and_check_config_refuse_wrong_key_files(tmp_path: Path) -> None:
    _, private, public = write_key_pair(tmp_path, "settings")
    config = tmp_path / "c.toml"

    def coordinator(security: str) -> subprocess.CompletedProcess[str]:
        config.write_text(
            f'cluster = "c"\n[mqtt]\nurl = "mqtt://127.0.0.1:1"\n[security]\n{security}'
        )
        return cli("coordinator", "--config", str(config))

    none = coordinator("")
    assert none.returncode == 2 and "security.signing_key_file: required by the coordinator" in (
        none.stderr
    )
    swapped = coordinator(f'signing_key_file = "{public}"\n')
    assert swapped.returncode == 2 and "holds a public key" in swapped.stderr
    absent = coordinator(f'signing_key_file = "{tmp_path / "absent.key"}"\n')
    assert absent.returncode == 2 and "absent.key: No such file" in absent.stderr
    # a node given the private key as a trusted key
    config.write_text(f'[security]\ntrusted_keys = ["{private}"]\n')
    node = cli("check-config", str(config))
    assert node.returncode == 2 and "security.trusted_keys" in node.stderr
    assert "holds a private key" in node.stderr
    # an agent's host: trusted keys, no signing key here
    config.write_text(
        f'[security]\ntrusted_keys = ["{public}"]\n'
        f'signing_key_file = "{tmp_path / "signing" / "settings.key"}"\n'
    )
    ok = cli("check-config", str(config))
    assert ok.returncode == 0 and "no signing key here" in ok.stdout, ok.stderr
    legacy = tmp_path / "old.toml"
    legacy.write_text('[security]\nsettings_key_file = "/etc/hyperagent/settings.key"\n')
    old = cli("check-config", str(legacy))
    assert old.returncode == 2 and "replaced by signing_key_file" in old.stderr


# -- a rogue node ------------------------------------------------------------------------

ROGUE = textwrap.dedent(
    """
    # A node's process that holds the coordinator's public key and the broker: it reads the
    # genuine settings (retained) and publishes forgeries, each a newer version with a lower cap.
    import asyncio, hashlib, hmac, sys
    import aiomqtt, orjson
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    port, topic, public_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    pem = open(public_file, "rb").read()
    public = serialization.load_pem_public_key(pem)
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    trusted_id = hashlib.sha256(raw).hexdigest()[:16]

    def canonical(m):
        return orjson.dumps({k: v for k, v in m.items() if k != "signature"},
                            option=orjson.OPT_SORT_KEYS)

    async def main():
        async with aiomqtt.Client("127.0.0.1", port) as c:
            await c.subscribe(topic, qos=1)
            async with asyncio.timeout(20):
                genuine = orjson.loads((await anext(aiter(c.messages))).payload)
            body = {k: v for k, v in genuine.items() if k not in ("signature", "key_id")}
            body["settings"] = {**body["settings"], "power_cap_w": 100}
            mine = Ed25519PrivateKey.generate()
            mine_raw = mine.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            mine_id = hashlib.sha256(mine_raw).hexdigest()[:16]
            for i in range(5):
                m = {**body, "version": genuine["version"] + 1 + i, "key_id": trusted_id}
                if i == 0:  # the public key as an HMAC key, in the old scheme's field
                    del m["key_id"]
                    m["hmac"] = hmac.new(pem, canonical(m), "sha256").hexdigest()
                elif i == 1:  # the same, 64 bytes long, as the trusted key's signature
                    m["signature"] = hmac.new(raw, canonical(m), "sha512").hexdigest()
                elif i == 2:  # another Ed25519 key, under the trusted key's id
                    m["signature"] = mine.sign(canonical(m)).hex()
                elif i == 3:  # another Ed25519 key, under its own id
                    m["key_id"] = mine_id
                    m["signature"] = mine.sign(canonical(m)).hex()
                else:  # the genuine message replayed with a changed body, its signature kept
                    m = {**genuine, "version": m["version"], "settings": body["settings"]}
                await c.publish(topic, orjson.dumps(m), qos=1, retain=True)
            print("5 forgeries sent")

    asyncio.run(main())
    """
)
"""What a rogue node can do with the public key and a broker that lets it publish."""

NODES = ("n0", "n1")


def _metric(port: int, name: str, **labels: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


@pytest.mark.peer
async def test_a_node_holding_only_the_public_key_cannot_make_a_setting_applied(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    key, _, public = write_key_pair(tmp_path / "coordinator", "settings")
    topics = bus.Topics("rogue")
    ports = {node: free_port() for node in NODES}
    agents = []
    try:
        for node in NODES:
            config = tmp_path / f"{node}.toml"
            config.write_text(
                f'cluster = "rogue"\nnode = "{node}"\n[mqtt]\nurl = "{mosquitto.url}"\n'
                f'[agent]\nstate_dir = "{tmp_path / node}"\n'
                f'metrics_address = "127.0.0.1:{ports[node]}"\n'
                f'[security]\ntrusted_keys = ["{public}"]\n'
                f'[sources.job]\nsocket = "{tmp_path / node}.sock"\n'
            )
            agents.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "hyperagent.cli", "agent"),
                        *("--config", str(config)),
                        *("--replay", str(REPO / "fixtures/replay/v100s-8gpu-training")),
                    ],
                    stderr=(tmp_path / f"{node}.log").open("wb"),
                )
            )
        for port in ports.values():
            await asyncio.to_thread(wait_for_port, port, 60)
        # job j's rank on each node, on GPU 0 (a power cap goes only on a job's GPUs)
        ranks = [JobReporter("j", rank=0, gpu=0, socket_path=f"{tmp_path / n}.sock") for n in NODES]
        for rank in ranks:
            rank.report_step(samples=8, step_s=0.1, compute_s=0.1, comm_s=0.0)
        await wait_until(
            lambda: all(_metric(p, "hyperagent_job_gpus", job_id="j") for p in ports.values()), 60
        )
        acks: list[tuple[str, int, bool]] = []
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="coordinator") as c:
            await c.subscribe(topics.ack("j", "+"), qos=1)
            online = bus.encode({"state": "online", "node": "coordinator", "ts": time.time()})
            await c.publish(topics.coordinator_status(), online, qos=1, retain=True)
            genuine = bus.sign({**MESSAGE, "version": 1, "issued_at": time.time()}, key)
            await c.publish(topics.settings("j"), bus.encode(genuine), qos=1, retain=True)

            async def collect() -> None:
                async for incoming in c.messages:
                    ack = bus.decode(bytes(incoming.payload), "ack")  # type: ignore[arg-type]
                    acks.append((ack["node"], ack["version"], ack["ok"]))

            listener = asyncio.create_task(collect(), name="acks")
            try:
                await wait_until(lambda: len(acks) == len(NODES), 60)
                rogue = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-c",
                    ROGUE,
                    str(mosquitto.port),
                    topics.settings("j"),
                    str(public),
                    stdout=asyncio.subprocess.PIPE,
                )
                out, _ = await asyncio.wait_for(rogue.communicate(), 60)
                assert rogue.returncode == 0 and b"5 forgeries sent" in out

                expected = {"unsigned": 1.0, "bad_signature": 3.0, "unknown_key": 1.0}

                def refused() -> list[dict[str, float | None]]:
                    name = "hyperagent_settings_rejected_total"
                    return [
                        {reason: _metric(port, name, reason=reason) for reason in expected}
                        for port in ports.values()
                    ]

                async with asyncio.timeout(30):
                    while await asyncio.to_thread(refused) != [expected] * len(NODES):
                        await asyncio.sleep(0.2)
                await asyncio.sleep(1)  # time for an ack that should not come
            finally:
                listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)
        for rank in ranks:
            rank.close()
    finally:
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        for agent in agents:
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
    assert sorted(acks) == [(node, 1, True) for node in NODES]  # the genuine version only
    for node in NODES:
        applied = orjson.loads((tmp_path / node / "applied-settings.json").read_bytes())
        assert applied["j"]["version"] == 1 and applied["j"]["settings"]["power_cap_w"] == 150
        log = (tmp_path / f"{node}.log").read_text()
        for reason in ("unsigned", "unknown_key", "bad_signature"):
            assert f"rejected settings ({reason})" in log, reason
        assert "applied settings v1 " in log and "applied settings v2" not in log


# -- a key rotation mid-tuning -----------------------------------------------------------

TRIALS = 6


@pytest.mark.peer
async def test_a_key_rotation_mid_tuning_loses_no_trial(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """README's rotation: the new public key added to the nodes' trusted directory while their
    agents run, then the coordinator restarted (SIGTERM, as systemctl restart) mid-trial with
    the new key: its journal resumes, the versions published under the old key stay valid,
    every trial of the budget is measured once and the tuning ends applied everywhere."""
    old, old_private, old_public = write_key_pair(tmp_path / "signing", "settings")
    new, new_private, new_public = write_key_pair(tmp_path / "signing", "settings-2")
    trusted_dir = tmp_path / "trusted-keys"
    trusted_dir.mkdir(mode=0o755)
    shutil.copy(old_public, trusted_dir / "settings.pub")
    trusted = TrustedKeys(paths=[trusted_dir])
    config = coordinator_config(tmp_path, mosquitto, old_private)
    journal = tmp_path / "state" / f"{JOB}.jsonl"
    async with simulated_cluster(
        mosquitto.url, nodes=2, trials=TRIALS, seed=7, speedup=60, key=old, trusted=trusted
    ) as (_, nodes, _):
        first = start(config)
        try:
            await wait_until(lambda: mid_trial(journal), 120)
            switched_in = entries(journal)[-1]["trial"]  # a trial published, not yet measured
            shutil.copy(new_public, trusted_dir / "settings-2.pub")
            first.send_signal(signal.SIGTERM)
            await asyncio.to_thread(first.wait, 30)
        finally:
            if first.poll() is None:
                first.kill()
        coordinator_config(tmp_path, mosquitto, new_private)
        second = start(config)
        try:
            final = await final_applied(journal, nodes)
        finally:
            second.send_signal(signal.SIGTERM)
            await asyncio.to_thread(second.wait, 30)
        rejected = [dict(n.agent.stats.rejected) for n in nodes]
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
            await client.subscribe(bus.Topics("demo").settings(JOB), qos=1)
            async with asyncio.timeout(10):
                retained = await anext(aiter(client.messages))
    assert (first.returncode, second.returncode) == (0, 0)
    log = entries(journal)
    trials = [e for e in log if e["type"] == "trial"]
    budget = [t["index"] for t in trials if not t.get("confirmation")]
    assert budget == list(range(TRIALS)), budget  # none lost, none twice
    assert all(t["status"] == "ok" for t in trials), [(t["index"], t["status"]) for t in trials]
    assert switched_in in budget
    versions = [e["version"] for e in log if e["type"] in ("published", "final")]
    assert versions == sorted(versions)
    message = bus.decode(retained.payload, "settings")  # type: ignore[arg-type]
    assert message["version"] == final["version"] and message["key_id"] == new.key_id
    assert bus.verify(message, new.trusted()) and not bus.verify(message, old.trusted())
    assert set(trusted.ids) == {old.key_id, new.key_id}  # read again once the new key signed
    for counts in rejected:
        assert not {"unknown_key", "bad_signature", "unsigned"} & counts.keys(), counts
