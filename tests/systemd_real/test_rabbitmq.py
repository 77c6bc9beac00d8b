"""The install (docs/install/systemd.md) with the broker of "Installing with RabbitMQ instead of
mosquitto" (docs/install/rabbitmq.md), run as written on a Debian 12 host booted under a real
systemd that has no mosquitto, then a job tuned to its result over RabbitMQ's MQTT plugin.

The script is test_installed's with the mosquitto block replaced: the RabbitMQ page's
first ```sh block (the package, from the Debian mirror) runs before boot with the host's
network, as the Python package does; its other blocks run, booted, where the mosquitto block
stood. What the operator supplies is test_installed's ``operator_supplies``.
"""

from __future__ import annotations

import re
import time
import tomllib
from collections.abc import Iterator

import pytest
from test_cluster import until
from test_installed import (
    DAEMONS,
    JOB,
    JOURNAL_ERRORS,
    NODE,
    Installed,
    booted_install,
    readme_install,
    shell_blocks,
    start_job,
    tuned_to_a_result,
)

from conftest import REPO

pytestmark = pytest.mark.timeout(1800)

BROKER = "rabbitmq-server"
UNITS = (BROKER, *DAEMONS)
BROKER_LOG = f"/var/log/rabbitmq/rabbit@{NODE}.log"
CLUSTER = tomllib.loads((REPO / "systemd" / "hyperagent.toml").read_text())["cluster"]
"""The shipped hyperagent.toml's cluster, which the test installs."""


RABBITMQ_PAGE = REPO / "docs" / "install" / "rabbitmq.md"
"""The install page's broker as RabbitMQ: "Installing with RabbitMQ instead of mosquitto"."""


def rabbitmq_section(page: str) -> str:
    """The RabbitMQ page's text, from its title: its ```sh blocks replace the mosquitto block."""
    return page.split("# Installing with RabbitMQ instead of mosquitto\n", 1)[1]


def rabbitmq_script() -> tuple[list[str], list[str]]:
    """The install section's blocks with the RabbitMQ subsection's in place of mosquitto's:
    (the scripts run before boot, the steps run booted)."""
    _, blocks = readme_install()
    rabbitmq = shell_blocks(rabbitmq_section(RABBITMQ_PAGE.read_text()))
    assert len(rabbitmq) >= 2 and "apt-get install" in rabbitmq[0], (
        "the RabbitMQ page gives no script: its ```sh blocks, the package first"
    )
    mosquitto = [i for i, block in enumerate(blocks) if "mosquitto_passwd" in block]
    assert len(mosquitto) == 1, "the install page has no one mosquitto block"
    i = mosquitto[0]
    return [blocks[0], rabbitmq[0]], [*blocks[1:i], *rabbitmq[1:], *blocks[i + 1 :]]


@pytest.fixture(scope="module")
def installed(request: pytest.FixtureRequest) -> Iterator[Installed]:
    before_boot, steps = rabbitmq_script()
    with booted_install(
        request, before_boot, steps, BROKER, BROKER_LOG, masked=("mosquitto",)
    ) as host:
        yield host


def test_rabbitmq_and_the_daemons_run_as_the_readme_says(installed: Installed) -> None:
    for unit in UNITS:
        assert until(lambda unit=unit: installed.running(unit), 60, f"{unit} running"), unit
    assert installed.show("mosquitto")["ActiveState"] == "inactive"
    listeners = installed.sh("rabbitmq-diagnostics -q listeners")
    protocols = dict(re.findall(r"port: (\d+), protocol: (\S+),", listeners))
    assert protocols.get("8883") == "mqtt/ssl", listeners
    assert "mqtt," not in listeners.replace("mqtt/ssl,", ""), "a plaintext MQTT listener"
    assert re.search(r"Interface: 127\.0\.0\.1, port: 5672, protocol: amqp", listeners), listeners
    users = installed.sh("rabbitmqctl -s list_users")
    assert sorted(line.split("\t")[0] for line in users.splitlines()) == [
        "coordinator",
        NODE,
    ], users
    # the coordinator's persistent session in a quorum queue
    queue = f"mqtt-subscription-hyperagent-coordinator-{CLUSTER}qos1"

    def listed() -> str:
        queues = installed.sh("rabbitmqctl -s list_queues -p hyperagent name type")
        return queues if queue in queues else ""

    queues = until(listed, 60, "the coordinator's session queue")
    assert re.search(rf"(?m)^{re.escape(queue)}\s+quorum$", queues), queues


def test_a_job_is_tuned_to_a_result_over_rabbitmq(installed: Installed) -> None:
    started = time.monotonic()
    start_job(installed)
    tuned_to_a_result(installed)
    installed.figures["tuned in"] = f"{time.monotonic() - started:.0f} s"
    log = installed.journal(*UNITS) + installed.sh(f"cat {BROKER_LOG}")
    assert not JOURNAL_ERRORS.findall(log), [
        line for line in log.splitlines() if JOURNAL_ERRORS.search(line)
    ]
    assert "access to topic" not in log, "the broker refused a daemon a topic"


def test_the_node_s_user_writes_neither_settings_nor_another_node_s_report(
    installed: Installed,
) -> None:
    """With the node's own credentials, as root on the node could: RabbitMQ refuses."""
    root = f"hyperagent/v1/{CLUSTER}"
    forged = [f"{root}/job/{JOB}/settings", f"{root}/job/{JOB}/report/gpu-018"]
    tried = []
    for topic in forged:
        result = installed.host.sh(
            f"mosquitto_pub -h mqtt.cluster.internal -p 8883 --cafile /etc/hyperagent/mqtt-ca.crt"
            f' -u {NODE} -P "$(cat /etc/hyperagent/mqtt.password)" -i forger -q 1'
            f" -t {topic} -m forged",
            check=False,
            timeout_s=30,
        )
        tried.append(f"{topic}: exit {result.returncode} {result.stdout}{result.stderr}")
    for topic in forged:
        refusal = (
            f"access to topic '{topic.replace('/', '.')}' in exchange 'amq.topic' in vhost"
            f" 'hyperagent' refused for user '{NODE}'"
        )
        assert until(lambda r=refusal: r in installed.sh(f"cat {BROKER_LOG}"), 10, refusal), tried
    assert installed.running(DAEMONS[1])


def test_the_daemons_and_rabbitmq_stop_cleanly(installed: Installed) -> None:
    for unit in (f"{JOB}-ranks", *DAEMONS, BROKER):
        started = time.monotonic()
        installed.sh(f"systemctl stop {unit}", timeout_s=90)
        installed.figures[f"{unit} stop"] = f"{time.monotonic() - started:.1f} s"
    for unit in (*DAEMONS, BROKER):
        props = installed.show(unit)
        assert props["ActiveState"] == "inactive" and props["Result"] == "success", (unit, props)
