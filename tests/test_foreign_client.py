#!/usr/bin/env python3
"""A foreign client against a real neurocoord (issue 15): Python's zmq and
msgpack, not our client code or our encoder. Every message is built from
docs/protocol.md (a msgpack map whose first keys are "v" and "t", then the
type's fields, "tensors" where the type carries frames), so the test checks
the documented wire format. Keys are our key files (neuroctl keygen: Z85 on
one line, "#" comments), used through pyzmq's CURVE.

  paths    a client's training job naming data, resume or checkpoint_dir
           outside the coordinator's roots (absolute, "..", a symbolic
           link inside the root, the coordinator's own secret key, a FIFO)
           fails with JOB_STATUS state 3 naming the parameter, at once,
           saying nothing of the file; the same job with paths inside the
           roots passes those checks
  roles    a client key's JOIN, LOAD_DONE and GRAD_NORM are refused with
           ERROR NL_ERR_AUTH (4); the nodes' socket refuses a client key's
           handshake and the clients' socket a node key's (finding 8); a
           node key's JOB_SUBMIT is refused
  flood    a client that sends queries and never reads stalls no one:
           another client's round trip stays under 1 s
  big      a client key's one message of 64 parts of 64 MiB to the
           clients' socket: the connection is dropped, the coordinator's
           resident memory stays bounded, another client is served in 1 s
  log      a node's free text (ERROR, JOB_STATUS, LEAVE) with newlines,
           escapes and control characters reaches the log escaped: no
           forged line, no raw control byte

Exit 0 when all pass, 1 on a failure, 77 (skipped) without python3-zmq or
python3-msgpack.
"""
import os
import re
import subprocess
import sys
import tempfile
import time

try:
    import msgpack
    import zmq
    import zmq.utils.monitor
except ImportError as e:
    print("test_foreign_client: skipped: %s (install python3-zmq and python3-msgpack)" % e)
    sys.exit(77)

B = os.environ.get("NL_BUILD_DIR", "build")
N = os.path.join(B, "cli", "neuroctl")
COORD = os.path.join(B, "coordinator", "neurocoord")
fails = 0

# docs/protocol.md: the version, message types, job states and statuses
V = 1
HELLO, HELLO_ACK, ERROR = 1, 2, 3
JOIN, ACCEPT, HEARTBEAT, LEAVE = 10, 11, 12, 13
LOAD_DONE = 22
JOB_SUBMIT, JOB_STATUS, JOB_CANCEL, JOB_QUERY = 40, 41, 42, 43
GRAD_NORM = 50
ROLE_COORDINATOR, ROLE_NODE, ROLE_CLIENT = 1, 2, 3
JOB_RUNNING, JOB_FAILED = 1, 3
ERR_AUTH = 4


def check(cond, msg):
    global fails
    if not cond:
        fails += 1
        print("FAIL:", msg, file=sys.stderr)
    return cond


def header(t, **fields):
    """The header of message type t: "v" first, "t" second, then fields."""
    h = {"v": V, "t": t}
    h.update(fields)
    return msgpack.packb(h, use_bin_type=True)


def read_key(path):
    """A key file of ours: the Z85 key on the first line not a comment."""
    for line in open(path):
        line = line.strip()
        if line and not line.startswith("#"):
            return line.encode()
    raise ValueError("%s: no key" % path)


class Peer:
    """A DEALER with CURVE keys PREFIX.key/.pub, connected to ep."""

    def __init__(self, ctx, prefix, ep, server, monitor=False, **opts):
        self.s = ctx.socket(zmq.DEALER)
        self.s.linger = 0
        self.s.curve_secretkey = read_key(prefix + ".key")
        self.s.curve_publickey = read_key(prefix + ".pub")
        self.s.curve_serverkey = server
        for k, v in opts.items():
            self.s.setsockopt(getattr(zmq, k), v)
        self.mon = self.s.get_monitor_socket() if monitor else None
        self.s.connect(ep)

    def send(self, t, frames=(), **fields):
        self.s.send_multipart([header(t, **fields)] + list(frames), copy=False)

    def recv(self, timeout=5.0):
        """The next message as (header dict, frames), or None."""
        if not self.s.poll(int(timeout * 1000)):
            return None
        parts = self.s.recv_multipart()
        return msgpack.unpackb(parts[0], raw=False), parts[1:]

    def until(self, want, timeout=5.0):
        """The next message of a type in want (others skipped), or None."""
        end = time.time() + timeout
        while time.time() < end:
            m = self.recv(end - time.time())
            if m and m[0]["t"] in want:
                return m
        return None

    def events(self, timeout):
        """The socket monitor's events within timeout (a set of codes)."""
        seen, end = set(), time.time() + timeout
        while time.time() < end and self.mon.poll(int((end - time.time()) * 1000) + 1):
            ev = zmq.utils.monitor.recv_monitor_message(self.mon)
            seen.add(ev["event"])
        return seen

    def close(self):
        if self.mon is not None:
            self.s.disable_monitor()
            self.mon.close(0)
        self.s.close(0)


def hello(p, role=ROLE_CLIENT):
    p.send(HELLO, role=role, software="pyzmq-foreign-test")
    m = p.until({HELLO_ACK, ERROR})
    return m and m[0]["t"] == HELLO_ACK and m[0]["role"] == ROLE_COORDINATOR


def round_trip(p):
    """Seconds until the coordinator answers a status query (99: never)."""
    t0 = time.time()
    p.send(JOB_QUERY, job_id=0)
    m = p.until({JOB_STATUS}, timeout=5.0)
    return time.time() - t0 if m and m[0]["job_id"] == 0 else 99.0


def rss_kib(pid):
    for line in open("/proc/%d/status" % pid):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


# ---------------------------------------------------------------- the tests


def train_params(data, checkpoint_dir, resume=None):
    """A training job's params (docs/training.md, "The client")."""
    p = {"data": data, "steps": 2, "batch": 2, "seq": 16, "microbatches": 1, "lr": 1e-3,
         "min_lr": 1e-4, "warmup": 0, "seed": 1, "holdout": 0.0, "eval_every": 0,
         "eval_batches": 1, "checkpoint_every": 0, "checkpoint_dir": checkpoint_dir,
         "recompute": False, "final_checkpoint": True, "seq_default": True}
    if resume is not None:
        p["resume"] = resume
    return p


def submit_train(p, params):
    """Submit; the first JOB_STATUS that names a job (or fails at once)."""
    p.send(JOB_SUBMIT, kind=2, params=params, tensors=[])
    return p.until({JOB_STATUS, ERROR}, timeout=5.0)


def test_paths(alice, W):
    data, ck = W + "/data", W + "/ckpt"
    secret = W + "/coord/coordinator.key"
    os.symlink(secret, data + "/link")
    os.mkfifo(data + "/fifo")
    os.symlink("/tmp", ck + "/out")
    os.symlink(W + "/elsewhere/manifest.json", ck + "/mlink")
    ok = data + "/ok.txt"
    hostile = [
        ("data", dict(data="/etc/passwd", checkpoint_dir="run"), "/etc/passwd"),
        ("data", dict(data=secret, checkpoint_dir="run"), secret),
        ("data", dict(data="../coord/coordinator.key", checkpoint_dir="run"), secret),
        ("data", dict(data=data + "/link", checkpoint_dir="run"), secret),
        ("data", dict(data="link", checkpoint_dir="run"), secret),
        ("data", dict(data=data + "/fifo", checkpoint_dir="run"), None),
        ("data", dict(data=W + "/data/../coord/coordinator.key", checkpoint_dir="run"), secret),
        ("resume", dict(data=ok, checkpoint_dir="run", resume="/nonexistent/manifest.json"), None),
        ("resume", dict(data=ok, checkpoint_dir="run", resume="mlink"),
         W + "/elsewhere/manifest.json"),
        ("resume", dict(data=ok, checkpoint_dir="run", resume=secret), secret),
        ("checkpoint_dir", dict(data=ok, checkpoint_dir="/tmp/nl-foreign-evil"), None),
        ("checkpoint_dir", dict(data=ok, checkpoint_dir="../escape"), None),
        ("checkpoint_dir", dict(data=ok, checkpoint_dir="out/x"), None),
    ]
    for what, paths, target in hostile:
        t0 = time.time()
        m = submit_train(alice, train_params(**paths))
        took = time.time() - t0
        h = m[0] if m else {}
        msg = h.get("message", "")
        label = "%s=%r" % (what, paths.get(what))
        if not check(h.get("t") == JOB_STATUS and h.get("state") == JOB_FAILED,
                     "%s: not refused with JOB_STATUS failed: %r" % (label, h)):
            continue
        check(h["job_id"] > 0 and ("params." + what) in msg,
              "%s: the refusal does not name params.%s: %r" % (label, what, msg))
        check(took < 2.0, "%s: refused after %.1f s (opened?)" % (label, took))
        if target and os.path.exists(target):
            size = str(os.path.getsize(target))
            check(size not in msg.split() and not re.search(r"[0-9a-f]{16}", msg),
                  "%s: the refusal says something of %s: %r" % (label, target, msg))
    check(not os.path.exists("/tmp/nl-foreign-evil") and not os.path.exists(W + "/escape"),
          "a checkpoint directory was made outside the root")
    # the same job inside the roots passes every path check: it fails only
    # because no node has joined (so the refusals above were the paths')
    m = submit_train(alice, train_params(data="ok.txt", checkpoint_dir="run"))
    h = m[0] if m else {}
    check(h.get("t") == JOB_STATUS and h.get("state") == JOB_RUNNING,
          "a job with paths inside the roots: %r" % (h,))
    m = alice.until({JOB_STATUS})
    check(m and m[0]["state"] == JOB_FAILED and "not ready" in m[0]["message"],
          "a job inside the roots on a cluster without nodes: %r" % (m and m[0],))
    check(round_trip(alice) < 1.0, "the coordinator answers after the hostile paths")
    print("paths: %d hostile jobs refused, each naming its parameter" % len(hostile))


def test_roles(ctx, W, eps, server):
    rogue = Peer(ctx, W + "/k/rogue", eps["client"], server)
    check(hello(rogue), "a client key's HELLO on the clients' socket")
    forged = [
        (JOIN, dict(pubkey=read_key(W + "/k/rogue.pub").decode(), device="cpu",
                    memory_bytes=2**64 - 1, gemm_gflops=1e6, threads=1,
                    data_endpoint="tcp://10.0.0.1:1")),
        (LOAD_DONE, dict(epoch=1, node_id=1, tensors=0, bytes=0)),
        (GRAD_NORM, dict(job_id=1, step=1, stage=0, sumsq=1.0)),
    ]
    for t, fields in forged:
        rogue.send(t, **fields)
        m = rogue.until({ERROR})
        h = m[0] if m else {}
        check(h.get("code") == ERR_AUTH and h.get("req_type") == t and
              "not for a key of this role" in h.get("message", ""),
              "a client key's type %d: %r" % (t, h))
    rogue.close()
    # finding 8: each socket admits its role's keys alone (the handshake fails)
    for who, ep in (("rogue", eps["node"]), ("nodeA", eps["client"])):
        p = Peer(ctx, W + "/k/" + who, ep, server, monitor=True)
        ev = p.events(3.0)
        check(zmq.EVENT_HANDSHAKE_FAILED_AUTH in ev and zmq.EVENT_HANDSHAKE_SUCCEEDED not in ev,
              "%s's handshake at %s: events %s" % (who, ep, sorted(ev)))
        p.close()
    node = Peer(ctx, W + "/k/nodeB", eps["node"], server)
    check(hello(node, ROLE_NODE), "a node key's HELLO on the nodes' socket")
    node.send(JOB_SUBMIT, kind=0, params={}, tensors=[])
    m = node.until({ERROR})
    check(m and m[0]["code"] == ERR_AUTH and m[0]["req_type"] == JOB_SUBMIT,
          "a node key's JOB_SUBMIT: %r" % (m and m[0],))
    node.close()
    print("roles: JOIN, LOAD_DONE, GRAD_NORM from a client key refused; keys only on their socket")


def test_flood(ctx, W, eps, server, alice, log):
    flood = Peer(ctx, W + "/k/flood", eps["client"], server, RCVHWM=1, RCVBUF=4096,
                 SNDHWM=100000, SNDTIMEO=0)
    check(hello(flood), "the flooding client's HELLO")
    sent, worst, t0 = 0, 0.0, time.time()
    q = header(JOB_QUERY, job_id=0)
    while time.time() - t0 < 3.0:
        for _ in range(200):
            try:
                flood.s.send(q, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
        worst = max(worst, round_trip(alice))
    check(worst < 1.0, "another client's round trip took %.2f s while one floods" % worst)
    check("to a client dropped" in open(log).read(),
          "the flood never filled the client's queue (no reply dropped): no test")
    flood.close()
    print("flood: %d queries never read; another client's slowest round trip %.3f s" %
          (sent, worst))
    return sent


def test_big(W, eps, server, alice, pid):
    part = bytearray(b"\x5a" * (64 << 20))
    # a context of its own: its I/O thread, busy encrypting 64 MiB parts,
    # must not delay alice's messages on this side
    ctx = zmq.Context()
    big = Peer(ctx, W + "/k/big", eps["client"], server, monitor=True, SNDTIMEO=2000)
    time.sleep(0.3)
    base = peak = rss_kib(pid)
    view = memoryview(part)
    for i in range(64):
        big.s.send(view, zmq.SNDMORE if i < 63 else 0, copy=False)
    dropped, worst, end = False, 0.0, time.time() + 30
    while time.time() < end and peak - base < (256 << 10):
        worst = max(worst, round_trip(alice))
        peak = max(peak, rss_kib(pid))
        if not dropped and zmq.EVENT_DISCONNECTED in big.events(0.05):
            dropped, end = True, time.time() + 1.0
    check(dropped, "the coordinator kept the connection of a client sending 64 MiB parts")
    check(peak - base < (256 << 10), "the coordinator's resident memory grew %d MiB for a "
          "client's 64 x 64 MiB message" % ((peak - base) >> 10))
    check(worst < 1.0, "another client's round trip took %.2f s during the big message" % worst)
    big.close()
    ctx.destroy(linger=0)
    print("big: 64 x 64 MiB from a client key: the coordinator grew %d MiB, another client's "
          "slowest round trip %.3f s" % ((peak - base) >> 10, worst))


EVIL = "boom\n12:00:00.000 ERROR [coord] FORGED-LINE \x1b[31mred\x07\r\x7f"


def test_log(ctx, W, eps, server, log):
    node = Peer(ctx, W + "/k/nodeA", eps["node"], server)
    check(hello(node, ROLE_NODE), "a node's HELLO")
    node.send(JOIN, pubkey=read_key(W + "/k/nodeA.pub").decode(), device="cpu",
              memory_bytes=1 << 30, gemm_gflops=1.0, threads=1, data_endpoint="tcp://127.0.0.1:9")
    m = node.until({ACCEPT, ERROR})
    if not check(m and m[0]["t"] == ACCEPT, "a node's JOIN: %r" % (m and m[0],)):
        return
    nid = m[0]["node_id"]
    node.send(ERROR, code=17, req_type=0, message=EVIL)
    node.send(JOB_STATUS, job_id=4242, state=JOB_FAILED, progress=0.0, message=EVIL, tensors=[])
    node.send(LEAVE, node_id=nid, reason=EVIL)
    escaped = r"boom\n12:00:00.000 ERROR [coord] FORGED-LINE \x1b[31mred\x07\r\x7f"
    text = ""
    for _ in range(50):
        time.sleep(0.1)
        text = open(log, encoding="utf-8", errors="replace").read()
        if text.count(escaped) >= 3:
            break
    check(text.count(escaped) >= 3, "the three free-text fields are not in the log escaped "
          "(%d of 3)" % text.count(escaped))
    check(not any("FORGED-LINE" in l and not l.startswith(tuple("0123456789")) or
                  l.startswith("12:00:00.000") for l in text.splitlines()),
          "a forged line in the log")
    raw = [c for c in "\x1b\x07\r\x7f" if c in text]
    check(not raw, "raw control characters in the log: %r" % raw)
    node.close()
    print("log: ERROR, JOB_STATUS and LEAVE text logged escaped")


def main():
    W = tempfile.mkdtemp(prefix="nl_foreign_")
    for d in ("k", "coord", "data", "ckpt", "elsewhere"):
        os.makedirs(os.path.join(W, d), mode=0o700)
    open(W + "/data/ok.txt", "w").write("hello world, a little text to train on\n" * 20)
    open(W + "/elsewhere/manifest.json", "w").write("{}")
    lines = []
    for name, role in (("alice", "client"), ("rogue", "client"), ("flood", "client"),
                       ("big", "client"), ("nodeA", "node"), ("nodeB", "node")):
        out = subprocess.run([N, "keygen", "--out", W + "/k/" + name, "--role", role],
                             capture_output=True, text=True, check=True).stdout
        lines.append(out.strip())
    with open(W + "/coord/authorized_keys", "w") as f:
        f.write("\n".join(lines) + "\n")
    log = W + "/coord.log"
    p = subprocess.Popen([COORD, "--listen", "tcp://127.0.0.1:*", "--state-dir", W + "/coord",
                          "--min-nodes", "3", "--node-timeout-ms", "60000", "--data-root",
                          W + "/data", "--checkpoint-root", W + "/ckpt"],
                         stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    ctx = zmq.Context()
    try:
        for _ in range(100):
            if os.path.exists(W + "/coord/endpoint") or p.poll() is not None:
                break
            time.sleep(0.1)
        eps = {"node": open(W + "/coord/endpoint").read().strip(),
               "client": open(W + "/coord/client_endpoint").read().strip()}
        check(eps["node"] != eps["client"], "one endpoint for nodes and clients: %s" % eps)
        server = read_key(W + "/coord/coordinator.pub")
        alice = Peer(ctx, W + "/k/alice", eps["client"], server)
        if not check(hello(alice), "a client's HELLO (msgpack from docs/protocol.md)"):
            return 1
        test_paths(alice, W)
        test_roles(ctx, W, eps, server)
        test_flood(ctx, W, eps, server, alice, log)
        test_big(W, eps, server, alice, p.pid)
        test_log(ctx, W, eps, server, log)
        check(p.poll() is None, "the coordinator is still running")
        alice.close()
    finally:
        ctx.destroy(linger=0)
        if p.poll() is None:
            p.terminate()
        check(p.wait(timeout=30) == 0, "neurocoord stops cleanly on SIGTERM")
        if fails:
            print("coordinator log: %s" % log, file=sys.stderr)
        else:
            subprocess.run(["rm", "-rf", W])
    print("test_foreign_client: %s" % ("ok" if not fails else "%d failures" % fails))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
