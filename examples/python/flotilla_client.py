#!/usr/bin/env python3
"""A small flotilla control client in Python: paho-mqtt and PyNaCl, nothing else.

It speaks the integration topics documented in docs/protocol.md: every control request is
signed with the operator's ed25519 key (the secret key file `flotilla operator keygen` writes:
the 32-byte seed in hex), and rollout status is watched on the retained
`{root}/v1/events/rollouts/{name}` topic.

    python3 flotilla_client.py --broker 127.0.0.1:1883 --key keys/alice.key create --spec fw.toml
    python3 flotilla_client.py --key keys/alice.key start fw-2-4
    python3 flotilla_client.py --key keys/alice.key status fw-2-4
    python3 flotilla_client.py --key keys/alice.key watch fw-2-4 --until-approval
    python3 flotilla_client.py --key keys/alice.key approve fw-2-4-before-canary
    python3 flotilla_client.py --key keys/alice.key watch fw-2-4 --until finished,failed

A broker with logins and TLS (the README's "Running it for real"), as the CLI logs in:

    python3 flotilla_client.py --broker mqtt.example.com:8883 --tls --ca-file broker-tls/ca.crt \
        --username flotilla-operator --password-file secrets/operator.password \
        --key keys/alice.key status fw-2-4

(or FLOTILLA_BROKER_USERNAME, FLOTILLA_BROKER_PASSWORD_FILE, FLOTILLA_BROKER_CA_FILE; a client
certificate with --client-cert and --client-key).

Debian: apt-get install python3-paho-mqtt python3-nacl. Exit codes: 0 done, 1 refused or
failed, 2 usage, 3 timed out.
"""

import argparse
import json
import os
import queue
import sys
import threading
import time
import uuid

import paho.mqtt.client as mqtt
from nacl.signing import SigningKey


def new_mqtt_client(client_id):
    """A paho client with the callback API of paho 1.x, under paho 1.x and 2.x alike."""
    try:
        return mqtt.Client(mqtt.CallbackAPIVersion.VERSION1, client_id=client_id)
    except AttributeError:  # paho-mqtt 1.x has no CallbackAPIVersion
        return mqtt.Client(client_id=client_id)


def load_key(path):
    with open(path, encoding="ascii") as f:
        return SigningKey(bytes.fromhex(f.read().strip()))


class Refused(Exception):
    """The coordinator answered ok: false."""


class FlotillaClient:
    """Sends signed control requests and waits for their replies on its own reply topic."""

    def __init__(self, host, port, key, root="flotilla", timeout=10.0, login=None, tls=None):
        """`login`: (user name, password) or None; `tls`: (CA file or None for the system's,
        client certificate or None, its key or None), or None for plain TCP."""
        self.key = key
        self.prefix = f"{root.rstrip('/')}/v1"
        self.timeout = timeout
        self.client_id = f"py-{uuid.uuid4().hex[:12]}"
        # Behind the shipped ACL a login may read only the reply topic named after it (and the
        # broker takes the login as the client id), as the CLI does.
        reply_name = login[0] if login else self.client_id
        self.reply_to = f"{self.prefix}/control/reply/{reply_name}"
        self.replies = queue.Queue()
        self.statuses = queue.Queue()
        self.subscribed = threading.Event()
        self.mqtt = new_mqtt_client(self.client_id)
        self.mqtt.on_connect = self._on_connect
        self.mqtt.on_subscribe = lambda *args: self.subscribed.set()
        self.mqtt.on_message = self._on_message
        self.refused = None
        if login:
            self.mqtt.username_pw_set(login[0], login[1])
        if tls:
            ca_file, cert, cert_key = tls
            self.mqtt.tls_set(ca_certs=ca_file, certfile=cert, keyfile=cert_key)
        try:
            self.mqtt.connect(host, port, keepalive=30)
        except OSError as e:
            raise Refused(f"cannot reach the broker at {host}:{port}: {e}") from None
        self.mqtt.loop_start()
        # Replies are not retained: subscribe before the first request is published.
        answered = self.subscribed.wait(self.timeout)
        if self.refused:
            self.mqtt.loop_stop()
            raise Refused(f"the broker at {host}:{port} refused the connection: {self.refused}")
        if not answered:
            raise TimeoutError(
                f"no SUBACK from the broker at {host}:{port} (wrong port, or TLS expected?)")

    def _on_connect(self, client, userdata, flags, rc):
        if rc != 0:
            # A wrong user name or password, or a certificate the broker does not know.
            self.refused = mqtt.connack_string(rc)
            self.subscribed.set()
            return
        client.subscribe(self.reply_to, qos=1)

    def _on_message(self, client, userdata, msg):
        if msg.topic == self.reply_to:
            self.replies.put(json.loads(msg.payload))
        elif msg.payload:
            self.statuses.put(json.loads(msg.payload))

    def close(self):
        self.mqtt.loop_stop()
        self.mqtt.disconnect()

    def sign(self, command, **fields):
        """The MQTT payload of a signed request: the request's exact JSON text, the public key
        and the signature over that text's UTF-8 bytes, both in hex."""
        request_id = uuid.uuid4().hex
        request = {
            "id": request_id,
            "reply_to": self.reply_to,
            "at": int(time.time()),  # inside the signed bytes: the clock window
            "nonce": os.urandom(16).hex(),  # inside the signed bytes: replay protection
            "command": command,
        }
        request.update(fields)
        text = json.dumps(request, separators=(",", ":"))
        signature = self.key.sign(text.encode("utf-8")).signature
        payload = {
            "request": text,
            "key": self.key.verify_key.encode().hex(),
            "signature": signature.hex(),
        }
        return request_id, json.dumps(payload).encode("utf-8")

    def request(self, command, **fields):
        """Sends one command; returns its result or raises Refused with the coordinator's reason."""
        request_id, payload = self.sign(command, **fields)
        self.mqtt.publish(f"{self.prefix}/control/request", payload, qos=1)
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply to {command} within {self.timeout}s; is the coordinator running?")
            try:
                reply = self.replies.get(timeout=left)
            except queue.Empty:
                continue
            if reply.get("id") != request_id:
                continue  # a late reply to an earlier request
            if not reply.get("ok"):
                raise Refused(reply.get("error") or "no reason given")
            return reply.get("result")

    def pages(self, command, page_size=500, **fields):
        """Yields every page of a paged list command (docs/protocol.md, "Pages"), following
        `next` until the last page, so no reply grows with the fleet."""
        after = None
        while True:
            extra = {"after": after} if after else {}
            page = self.request(command, limit=page_size, **fields, **extra)
            yield page
            after = page.get("next")
            if not after:
                return

    def rollout_status(self, rollout, page_size=500):
        """A rollout's summary with every device, fetched a page at a time."""
        status, devices = None, []
        for page in self.pages("rollout_status", page_size, rollout=rollout):
            status = page["status"]
            devices.extend(page["items"])
        status["device_list"] = devices
        return status

    def watch(self, rollout, done, timeout):
        """Yields each status of `rollout` from the retained event topic until `done(status)`."""
        self.mqtt.subscribe(f"{self.prefix}/events/rollouts/{rollout}", qos=1)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rollout {rollout}: not done within {timeout}s")
            try:
                status = self.statuses.get(timeout=left)
            except queue.Empty:
                continue
            if status.get("name") != rollout:
                continue
            yield status
            if done(status):
                return


def pending_approvals(status):
    return [a["name"] for a in status.get("approvals", []) if not a.get("approved")]


def describe(status):
    groups = ", ".join(
        f"{g['name']} {g['state']} {g['ready']}/{g['total']} ready" for g in status.get("groups", [])
    )
    line = f"{status['name']}: {status['state']} [{groups}]"
    if status.get("waiting"):
        line += f" waiting: {status['waiting']}"
    return line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", default=os.environ.get("FLOTILLA_BROKER", "127.0.0.1:1883"))
    parser.add_argument("--topic-root", default="flotilla")
    parser.add_argument("--key", default=os.environ.get("FLOTILLA_OPERATOR_KEY"),
                        help="the operator's secret key file (or FLOTILLA_OPERATOR_KEY)")
    parser.add_argument("--timeout", type=float, default=10.0)
    env = os.environ.get
    parser.add_argument("--username", default=env("FLOTILLA_BROKER_USERNAME"),
                        help="the broker login (or FLOTILLA_BROKER_USERNAME)")
    parser.add_argument("--password-file", default=env("FLOTILLA_BROKER_PASSWORD_FILE"),
                        help="a file whose first line is the password (or FLOTILLA_BROKER_PASSWORD_FILE)")
    parser.add_argument("--tls", action="store_true", help="TLS to the broker")
    parser.add_argument("--ca-file", default=env("FLOTILLA_BROKER_CA_FILE"),
                        help="the CA the broker's certificate chains to (implies --tls)")
    parser.add_argument("--client-cert", help="a client certificate for mutual TLS (implies --tls)")
    parser.add_argument("--client-key", help="its private key")
    sub = parser.add_subparsers(dest="cmd", required=True)
    create = sub.add_parser("create", help="create a rollout from a TOML spec file")
    create.add_argument("--spec", required=True)
    for name in ("start", "pause", "resume", "stop"):
        sub.add_parser(name, help=f"{name} a rollout").add_argument("rollout")
    status = sub.add_parser("status", help="print a rollout's summary and every device as JSON")
    status.add_argument("rollout")
    status.add_argument("--page-size", type=int, default=500,
                        help="devices asked for per request (the coordinator allows 1..2000)")
    sub.add_parser("approve", help="approve an approval request").add_argument("name")
    watch = sub.add_parser("watch", help="follow a rollout's status events")
    watch.add_argument("rollout")
    watch.add_argument("--until", default="finished,failed,stopped",
                       help="comma-separated states that end the watch")
    watch.add_argument("--until-approval", action="store_true",
                       help="end when an approval request is pending and print its name")
    watch.add_argument("--for", dest="watch_for", type=float, default=120.0)
    args = parser.parse_args(argv)
    if not args.key:
        parser.error("no operator key: pass --key FILE or set FLOTILLA_OPERATOR_KEY")
    host, _, port = args.broker.rpartition(":")
    login = None
    if args.username:
        if not args.password_file:
            parser.error("--username needs --password-file (or FLOTILLA_BROKER_PASSWORD_FILE)")
        with open(args.password_file, encoding="utf-8") as f:
            login = (args.username, f.readline().rstrip("\r\n"))
    tls = None
    if args.tls or args.ca_file or args.client_cert:
        tls = (args.ca_file, args.client_cert, args.client_key)
    try:
        client = FlotillaClient(host, int(port), load_key(args.key), args.topic_root,
                                args.timeout, login, tls)
    except Refused as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    except TimeoutError as e:
        print(f"timed out: {e}", file=sys.stderr)
        return 3
    try:
        if args.cmd == "create":
            with open(args.spec, encoding="utf-8") as f:
                result = client.request("create_rollout", spec=f.read())
            print(f"created {result['name']} ({result['state']})")
        elif args.cmd in ("start", "pause", "resume", "stop"):
            result = client.request(f"{args.cmd}_rollout", rollout=args.rollout)
            print(describe(result))
        elif args.cmd == "status":
            print(json.dumps(client.rollout_status(args.rollout, args.page_size), indent=2))
        elif args.cmd == "approve":
            result = client.request("approve", name=args.name)
            print(f"approved {result['name']}")
        elif args.cmd == "watch":
            until = set(args.until.split(","))
            if args.until_approval:
                done = lambda s: bool(pending_approvals(s)) or s["state"] in until
            else:
                done = lambda s: s["state"] in until
            last = None
            for status in client.watch(args.rollout, done, args.watch_for):
                print(describe(status), flush=True)
                last = status
            if args.until_approval:
                pending = pending_approvals(last)
                if not pending:
                    print(f"no approval pending; rollout is {last['state']}", file=sys.stderr)
                    return 1
                print(f"pending approval: {pending[0]}")
        return 0
    except Refused as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    except TimeoutError as e:
        print(f"timed out: {e}", file=sys.stderr)
        return 3
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
