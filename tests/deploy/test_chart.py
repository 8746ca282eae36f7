#!/usr/bin/env python3
"""The Helm chart rendered by the real helm (scripts/install-k8s-tools puts it, kubectl and the
API's schemas under /opt/gpusnap): `helm lint --strict`, every example values file and a set of
value combinations rendered, each render validated against the Kubernetes API's OpenAPI schemas
(types, enums, required and unknown fields) and by yamllint, each typo of the values refused
with its message, and what the renders promise an operator -- the namespace's Pod Security
labels, a PriorityClass admission accepts, a Role for one watched namespace, the grace period,
metrics behind a value, and probes that ask the programs whether they answer. The probes'
commands are run as rendered against the real gpusnap-agent and gpusnap-controller of this
build. Exits 77 ("skipped: helm not installed") without helm."""

import functools
import hashlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import yaml

ROOT = pathlib.Path(os.environ.get("GPUSNAP_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
CHART = ROOT / "deploy" / "helm" / "gpusnap"
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("values-*.yaml"))
TOOLS = pathlib.Path(os.environ.get("GPUSNAP_K8S_TOOLS", "/opt/gpusnap"))
HELM = TOOLS / "bin" / "helm"
MODELS = TOOLS / "k8s-tools"
VALIDATE = pathlib.Path(__file__).resolve().parent / "validate_k8s.mjs"

# Value combinations beyond the defaults and the examples: every branch of the templates.
VARIANTS = {
    "one-namespace": ["controller.namespace=ml-team"],
    "pvc": ["storage.type=pvc", "storage.pvc.create=true", "storage.pvc.storageClassName=cephfs"],
    "unprivileged": ["agent.privileged=false"],
    "no-controller": ["controller.enabled=false"],
    "own-namespace-and-priority": ["podSecurity.labelNamespace=false", "priorityClass.create=false",
                                   "priorityClassName=system-node-critical"],
    "metrics": ["metrics.enabled=true", "metrics.service.enabled=true", "metrics.port=9100"],
    "oci-plain": ["storage.type=oci", "storage.oci.registry=registry.local:5000",
                  "storage.oci.plainHttp=true"],
    "lanes": ["agent.maxPending=256", "agent.prefetchWorkers=4"],
    "oci-peers": ["storage.type=oci", "storage.oci.registry=registry.local:5000",
                  "agent.peers.enabled=true", "agent.peers.tokenSecret=gpusnap-peer-token"],
    "oci-encrypted": ["storage.type=oci", "storage.oci.registry=registry.local:5000",
                      "storage.oci.encryption.keysSecret=gpusnap-keys",
                      "storage.oci.encryption.dedupSecret=gpusnap-dedup",
                      "storage.oci.encryption.recipients.team\\.pub=PEM",
                      "storage.oci.signatureKeysSecret=gpusnap-signature-keys"],
}

# What an agent with keys renders to (the "oci-encrypted" variant).
ENCRYPTED = tuple(VARIANTS["oci-encrypted"])

# Typos the chart must refuse, and the message that names each.
BAD_VALUES = [
    (["storage.type=OCI"], "at '/storage/type': value must be one of 'hostPath', 'pvc', 'oci'"),
    (["controller.pollMillis=fast"], "at '/controller/pollMillis': got string, want integer"),
    (["controller.pollMillis=5"], "at '/controller/pollMillis': minimum: got 5, want 10"),
    (["agent.privileged=nope"], "at '/agent/privileged': got string, want boolean"),
    (["agent.logFormat=xml"], "at '/agent/logFormat': value must be one of 'text', 'json'"),
    (["storage.oci.cache.budgetMiB=64Gi"],
     "at '/storage/oci/cache/budgetMiB': got string, want integer"),
    (["storage.oci.plainHttp=yes"], "at '/storage/oci/plainHttp': got string, want boolean"),
    (["rbac.launchPods=no"], "at '/rbac/launchPods': got string, want boolean"),
    (["podSecurity.labelNamespace=off"],
     "at '/podSecurity/labelNamespace': got string, want boolean"),
    (["agent.terminationGracePeriodSeconds=15m"],
     "at '/agent/terminationGracePeriodSeconds': got string, want integer"),
    (["image.pullPolicy=always"],
     "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'"),
    (["storage.hostPath=var/lib/gpusnap"], "at '/storage/hostPath': 'var/lib/gpusnap' does not match"),
    (["storage.oci.registry=https://registry.example.com"],
     "at '/storage/oci/registry': 'https://registry.example.com' does not match"),
    (["storag.type=oci"], "at '': additional properties 'storag' not allowed"),
    (["controller.pollMs=100"], "at '/controller': additional properties 'pollMs' not allowed"),
    (["priorityClass.value=2000000000"],
     "at '/priorityClass/value': maximum: got 2×10⁰⁹, want 1×10⁰⁹"),
    (["priorityClass.preemptionPolicy=never"], "at '/priorityClass/preemptionPolicy': value must be"
     " one of 'Never', 'PreemptLowerPriority'"),
    (["metrics.port=http"], "at '/metrics/port': got string, want integer"),
    (["metrics.port=70000"], "at '/metrics/port': maximum: got 70,000, want 65,535"),
    (["metrics.enabled=on"], "at '/metrics/enabled': got string, want boolean"),
    (["storage.type=oci"], "storage.oci.registry is required with storage.type=oci"),
    (["agent.maxPending=many"], "at '/agent/maxPending': got string, want integer"),
    (["agent.maxPending=0"], "at '/agent/maxPending': minimum: got 0, want 1"),
    (["agent.prefetchWorkers=17"], "at '/agent/prefetchWorkers': maximum: got 17, want 16"),
    (["agent.prefetchWorkers=0"], "at '/agent/prefetchWorkers': minimum: got 0, want 1"),
    (["storage.oci.encryption.keySecret=keys"],
     "at '/storage/oci/encryption': additional properties 'keySecret' not allowed"),
]


def helm(*args, check=True):
    r = subprocess.run([str(HELM), *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed: {r.stderr}")
    return r


@functools.lru_cache(maxsize=None)
def render_text(*values, files=()):
    """helm template's output, as helm writes it (each rendering once: helm takes a second)."""
    args = ["template", "gpusnap", str(CHART), "--namespace", "gpusnap-system"]
    for f in files:
        args += ["-f", str(f)]
    for v in values:
        args += ["--set", v]
    return helm(*args).stdout


def render(*values, files=()):
    return [d for d in yaml.safe_load_all(render_text(*values, files=files)) if d]


def one(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def containers(docs):
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    return pod, {c["name"]: c for c in pod["containers"]}


class ChartTest(unittest.TestCase):
    def renders(self):
        """(name, helm's output) of the defaults, each example and each variant."""
        yield "defaults", render_text()
        for f in EXAMPLES:
            yield f.name, render_text(files=(f,))
        for name, values in VARIANTS.items():
            yield name, render_text(*values)

    def test_lint_is_strictly_clean(self):
        for files in [[]] + [[f] for f in EXAMPLES]:
            with self.subTest(values=[f.name for f in files]):
                args = ["lint", "--strict", str(CHART), "--namespace", "gpusnap-system"]
                for f in files:
                    args += ["-f", str(f)]
                r = helm(*args, check=False)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                self.assertIn("0 chart(s) failed", r.stdout)
                self.assertNotIn("[WARNING]", r.stdout)
                self.assertNotIn("funcMap fail", r.stdout + r.stderr)  # a template's fail()

    def test_every_render_matches_the_kubernetes_schemas(self):
        if shutil.which("node") is None or not (MODELS / "node_modules" / "kubernetes-models").is_dir():
            self.skipTest(f"node or kubernetes-models under {MODELS} missing (scripts/install-k8s-tools)")
        checked = 0
        manifest = (ROOT / "deploy" / "manifests" / "gpusnap.yaml").read_text()
        for name, text in [*self.renders(), ("deploy/manifests/gpusnap.yaml", manifest)]:
            with self.subTest(render=name):
                docs = [d for d in yaml.safe_load_all(text) if d]
                r = subprocess.run(["node", str(VALIDATE), str(MODELS)], input=json.dumps(docs),
                                   capture_output=True, text=True)
                self.assertEqual((r.returncode, r.stdout), (0, ""), r.stderr)
                checked += len(docs)
        self.assertGreaterEqual(checked, 40)

    def test_the_schema_check_refuses_what_the_api_server_would(self):
        # The validator itself can fail: a wrong type and a missing required field are named.
        if shutil.which("node") is None or not (MODELS / "node_modules" / "kubernetes-models").is_dir():
            self.skipTest(f"node or kubernetes-models under {MODELS} missing (scripts/install-k8s-tools)")
        docs = render()
        pod, _ = containers(docs)
        pod["terminationGracePeriodSeconds"] = "900"
        del one(docs, "ClusterRoleBinding")["roleRef"]["name"]
        agent = pod["containers"][0]
        agent["readinessProb"] = agent.pop("readinessProbe")
        r = subprocess.run(["node", str(VALIDATE), str(MODELS)], input=json.dumps(docs),
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn("DaemonSet gpusnap-agent: data/spec/template/spec/terminationGracePeriodSeconds"
                      " must be integer", r.stdout)
        self.assertIn("ClusterRoleBinding gpusnap-controller: data/roleRef must have required"
                      " property name", r.stdout)
        self.assertIn("DaemonSet gpusnap-agent: data/spec/template/spec/containers/0/readinessProb:"
                      " unknown field", r.stdout)
        self.assertEqual(len(r.stdout.splitlines()), 3, r.stdout)

    def test_every_render_passes_yamllint(self):
        if shutil.which("yamllint") is None:
            self.skipTest("yamllint is not installed (apt-get install yamllint)")
        # Sequences either way (the templates indent them, toYaml does not); the rest strict.
        config = ("{extends: default, rules: {line-length: {max: 120}, document-start: disable,"
                  " indentation: {spaces: consistent, indent-sequences: whatever}}}")
        for name, text in self.renders():
            with self.subTest(render=name):
                r = subprocess.run(["yamllint", "-s", "-d", config, "-"], input=text,
                                   capture_output=True, text=True)
                self.assertEqual(r.returncode, 0, r.stdout)

    def test_every_typo_is_refused_with_its_message(self):
        for values, message in BAD_VALUES:
            with self.subTest(values=values):
                args = ["template", "gpusnap", str(CHART), "--namespace", "gpusnap-system"]
                for v in values:
                    args += ["--set", v]
                r = helm(*args, check=False)
                self.assertNotEqual(r.returncode, 0, r.stdout[:300])
                self.assertIn(message, r.stderr)
                self.assertEqual(r.stdout, "")

    def test_namespace_is_labelled_privileged_unless_told_not_to(self):
        ns = one(render(), "Namespace")
        self.assertEqual(ns["metadata"]["name"], "gpusnap-system")
        for mode in ("enforce", "audit", "warn"):
            self.assertEqual(ns["metadata"]["labels"][f"pod-security.kubernetes.io/{mode}"],
                             "privileged")
        self.assertEqual(ns["metadata"]["annotations"]["helm.sh/resource-policy"], "keep")
        self.assertFalse([d for d in render("podSecurity.labelNamespace=false")
                          if d["kind"] == "Namespace"])
        # Never a shared namespace: the release would own it and relabel it.
        for shared in ("default", "kube-system"):
            r = helm("template", "gpusnap", str(CHART), "-n", shared, check=False)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn(f"podSecurity.labelNamespace would make the release own and relabel "
                          f"namespace {shared}", r.stderr)
            r = helm("template", "gpusnap", str(CHART), "-n", shared, "--set",
                     "podSecurity.labelNamespace=false", check=False)
            self.assertEqual(r.returncode, 0, r.stderr)

    def test_agent_runs_at_a_priority_admission_accepts(self):
        docs = render()
        pc = one(docs, "PriorityClass")
        pod, _ = containers(docs)
        self.assertEqual(pod["priorityClassName"], pc["metadata"]["name"])
        self.assertFalse(pc["metadata"]["name"].startswith("system-"))
        self.assertEqual((pc["value"], pc["preemptionPolicy"], pc["globalDefault"]),
                         (1000000000, "Never", False))
        pc = one(render("priorityClass.preemptionPolicy=PreemptLowerPriority"), "PriorityClass")
        self.assertEqual(pc["preemptionPolicy"], "PreemptLowerPriority")
        # A class of the operator's own replaces the chart's.
        docs = render("priorityClassName=system-node-critical")
        self.assertFalse([d for d in docs if d["kind"] == "PriorityClass"])
        self.assertEqual(containers(docs)[0]["priorityClassName"], "system-node-critical")
        pod, _ = containers(render("priorityClass.create=false"))
        self.assertNotIn("priorityClassName", pod)

    def test_one_watched_namespace_gets_a_role_there_not_a_cluster_role(self):
        docs = render("controller.namespace=ml-team")
        kinds = {d["kind"] for d in docs}
        self.assertFalse(kinds & {"ClusterRole", "ClusterRoleBinding"}, kinds)
        role, binding = one(docs, "Role"), one(docs, "RoleBinding")
        self.assertEqual((role["metadata"]["namespace"], binding["metadata"]["namespace"]),
                         ("ml-team", "ml-team"))
        self.assertEqual(binding["roleRef"], {"apiGroup": "rbac.authorization.k8s.io",
                                              "kind": "Role", "name": role["metadata"]["name"]})
        self.assertEqual(binding["subjects"], [{"kind": "ServiceAccount", "name": "gpusnap",
                                                "namespace": "gpusnap-system"}])
        _, c = containers(docs)
        self.assertIn("--namespace=ml-team", c["controller"]["args"])
        # The rules are the cluster-wide ones, nothing more.
        cluster = one(render(), "ClusterRole")
        self.assertEqual(role["rules"], cluster["rules"])

    def test_grace_period_and_startup_cover_the_agents_longest_waits(self):
        pod, c = containers(render())
        self.assertEqual(pod["terminationGracePeriodSeconds"], 900)
        startup = c["agent"]["startupProbe"]
        # The agent waits up to 10 minutes for a previous agent's capture guardians.
        self.assertGreaterEqual(startup["periodSeconds"] * startup["failureThreshold"], 600)
        pod, c = containers(render("agent.terminationGracePeriodSeconds=3600",
                                   "agent.startupSeconds=1200"))
        self.assertEqual(pod["terminationGracePeriodSeconds"], 3600)
        self.assertEqual(c["agent"]["startupProbe"]["failureThreshold"] *
                         c["agent"]["startupProbe"]["periodSeconds"], 1200)

    def test_the_plain_manifest_promises_what_the_chart_does(self):
        with open(ROOT / "deploy" / "manifests" / "gpusnap.yaml") as f:
            manifest = [d for d in yaml.safe_load_all(f) if d]
        chart = render()
        (m_pod, m), (c_pod, c) = containers(manifest), containers(chart)
        for key in ("terminationGracePeriodSeconds", "hostPID"):
            self.assertEqual(m_pod[key], c_pod[key], key)
        for name, probes in (("agent", ("startupProbe", "livenessProbe", "readinessProbe")),
                             ("controller", ("livenessProbe",))):
            for probe in probes:
                self.assertEqual(m[name][probe], c[name][probe], f"{name} {probe}")
        self.assertEqual(m["controller"]["args"], c["controller"]["args"])
        self.assertEqual(one(manifest, "Namespace")["metadata"]["labels"],
                         {k: v for k, v in one(chart, "Namespace")["metadata"]["labels"].items()
                          if k.startswith("pod-security.")})
        m_pc, c_pc = one(manifest, "PriorityClass"), one(chart, "PriorityClass")
        self.assertEqual(m_pod["priorityClassName"], m_pc["metadata"]["name"])
        self.assertEqual({k: m_pc[k] for k in ("value", "preemptionPolicy", "globalDefault")},
                         {k: c_pc[k] for k in ("value", "preemptionPolicy", "globalDefault")})

    def test_keys_are_mounted_from_secrets_for_root_alone(self):
        docs = render(*ENCRYPTED)
        pod, c = containers(docs)
        volumes = {v["name"]: v for v in pod["volumes"]}
        for name, secret in (("decryption-keys", "gpusnap-keys"), ("dedup", "gpusnap-dedup"),
                             ("signature-keys", "gpusnap-signature-keys")):
            with self.subTest(volume=name):
                self.assertEqual(volumes[name]["secret"]["secretName"], secret)
                self.assertEqual(volumes[name]["secret"]["defaultMode"], 0o400)
        mounts = {m["name"]: m for m in c["agent"]["volumeMounts"]}
        for name, path in (("decryption-keys", "/etc/gpusnap/keys"), ("dedup", "/etc/gpusnap/dedup"),
                           ("signature-keys", "/etc/gpusnap/signature-keys"),
                           ("recipients", "/etc/gpusnap/recipients")):
            with self.subTest(mount=name):
                self.assertEqual(mounts[name]["mountPath"], path)
                self.assertTrue(mounts[name]["readOnly"])
        args = c["agent"]["args"]
        self.assertIn("--decryption-key=/etc/gpusnap/keys", args)
        self.assertIn("--encrypt=/etc/gpusnap/recipients/team.pub", args)
        self.assertIn("--dedup-secret=/etc/gpusnap/dedup/dedup-secret", args)
        recipients = next(d for d in docs if d["kind"] == "ConfigMap" and
                          d["metadata"]["name"].endswith("-recipients"))
        self.assertEqual(recipients["data"], {"team.pub": "PEM"})
        # Without a shared dedup secret each node keeps its own where the agent's state lives.
        _, c = containers(render("storage.type=oci", "storage.oci.registry=r:5000",
                                 "storage.oci.encryption.recipients.a=PEM"))
        self.assertIn("--dedup-secret=/var/lib/gpusnap/agent/dedup-secret", c["agent"]["args"])
        # Without keys: none of it.
        _, c = containers(render(*VARIANTS["oci-plain"]))
        self.assertFalse([a for a in c["agent"]["args"]
                          if a.split("=")[0] in ("--decryption-key", "--encrypt", "--dedup-secret")])

    def test_metrics_are_off_until_asked_then_scrapable(self):
        docs = render()
        pod, c = containers(docs)
        self.assertFalse([a for a in c["agent"]["args"] if a.startswith("--metrics-listen")])
        self.assertNotIn("ports", c["agent"])
        self.assertNotIn("annotations", one(docs, "DaemonSet")["spec"]["template"]["metadata"])
        self.assertFalse([d for d in docs if d["kind"] == "Service"])
        docs = render("metrics.enabled=true", "metrics.service.enabled=true", "metrics.port=9100")
        ds = one(docs, "DaemonSet")
        pod, c = containers(docs)
        self.assertIn("--metrics-listen=0.0.0.0:9100", c["agent"]["args"])
        self.assertEqual(c["agent"]["ports"], [{"name": "metrics", "containerPort": 9100,
                                                "protocol": "TCP"}])
        scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": "9100",
                  "prometheus.io/path": "/metrics"}
        self.assertEqual(ds["spec"]["template"]["metadata"]["annotations"], scrape)
        service = one(docs, "Service")
        self.assertEqual(service["metadata"]["annotations"], scrape)
        self.assertEqual(service["spec"]["clusterIP"], "None")
        self.assertEqual(service["spec"]["selector"], ds["spec"]["selector"]["matchLabels"])
        self.assertEqual(service["spec"]["ports"], [{"name": "metrics", "port": 9100,
                                                     "targetPort": "metrics", "protocol": "TCP"}])
        # The agent takes the flag (its own --help, from this build).
        if os.environ.get("GPUSNAP_AGENT"):
            help_text = subprocess.run([os.environ["GPUSNAP_AGENT"], "--help"],
                                       capture_output=True, text=True, check=True).stdout
            self.assertIn("--metrics-listen ADDR:PORT", help_text)
        # Without the annotations, with the listener.
        docs = render("metrics.enabled=true", "metrics.podAnnotations=false")
        self.assertNotIn("annotations", one(docs, "DaemonSet")["spec"]["template"]["metadata"])

    def test_peers_are_off_until_asked_then_found_through_a_headless_service(self):
        _, c = containers(render("storage.type=oci", "storage.oci.registry=registry.local:5000"))
        self.assertFalse([a for a in c["agent"]["args"] if "peer" in a])
        docs = render(*VARIANTS["oci-peers"])
        ds = one(docs, "DaemonSet")
        pod, c = containers(docs)
        args = c["agent"]["args"]
        for flag in ["--listen=$(POD_IP):7070", "--token-file=/etc/gpusnap/peer-token/token",
                     "--serve-peers", "--peers-dns=gpusnap-peers.gpusnap-system.svc:7070",
                     "--peer-token-file=/etc/gpusnap/peer-token/token"]:
            self.assertIn(flag, args)
        self.assertIn({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                      c["agent"]["env"])
        self.assertEqual(c["agent"]["ports"], [{"name": "peers", "containerPort": 7070,
                                                "protocol": "TCP"}])
        volume = [v for v in pod["volumes"] if v["name"] == "peer-token"][0]
        self.assertEqual(volume["secret"], {"secretName": "gpusnap-peer-token", "defaultMode": 0o400})
        service = one(docs, "Service")
        self.assertEqual(service["metadata"]["name"], "gpusnap-peers")
        self.assertEqual(service["spec"]["clusterIP"], "None")
        self.assertEqual(service["spec"]["selector"], ds["spec"]["selector"]["matchLabels"])
        # Without the token's Secret the chart refuses, naming the value.
        out = helm("template", "t", str(CHART), "-n", "gpusnap-system", "--set", "storage.type=oci",
                   "--set", "storage.oci.registry=registry.local:5000", "--set",
                   "agent.peers.enabled=true", check=False)
        self.assertIn("agent.peers.tokenSecret is required", out.stderr)
        # The agent takes the flags (its own --help, from this build).
        if os.environ.get("GPUSNAP_AGENT"):
            help_text = subprocess.run([os.environ["GPUSNAP_AGENT"], "--help"],
                                       capture_output=True, text=True, check=True).stdout
            for flag in ["--serve-peers", "--peers-dns NAME:PORT", "--peer-token-file FILE"]:
                self.assertIn(flag, help_text)

    def test_lane_values_become_the_agents_flags_as_whole_numbers(self):
        _, c = containers(render())
        args = c["agent"]["args"]
        # The chart's defaults are the agent's own (its --help, from this build).
        self.assertIn("--max-pending=64", args)
        self.assertIn("--prefetch-workers=1", args)
        if os.environ.get("GPUSNAP_AGENT"):
            help_text = subprocess.run([os.environ["GPUSNAP_AGENT"], "--help"],
                                       capture_output=True, text=True, check=True).stdout
            self.assertRegex(help_text, r"--max-pending N\s+[^\n]*\n?[^\n]*\(default 64\)")
            self.assertRegex(help_text, r"--prefetch-workers N\s+[^\n]*\(default 1,")
        _, c = containers(render("agent.maxPending=256", "agent.prefetchWorkers=4"))
        self.assertIn("--max-pending=256", c["agent"]["args"])
        self.assertIn("--prefetch-workers=4", c["agent"]["args"])
        # From a values file YAML's numbers are floats to Helm, which writes a million as
        # 1.048576e+06 unless the template asks for an integer: the agent would refuse it.
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            yaml.safe_dump({"agent": {"maxPending": 1048576},
                            "storage": {"type": "oci", "oci": {"registry": "registry.local",
                                                               "cache": {"budgetMiB": 4194304}}}},
                           f)
            f.flush()
            _, c = containers(render(files=(f.name,)))
        self.assertIn("--max-pending=1048576", c["agent"]["args"])
        self.assertIn("--cache-budget-mib=4194304", c["agent"]["args"])

    def test_the_plain_manifest_gives_the_agent_the_charts_default_flags(self):
        with open(ROOT / "deploy" / "manifests" / "gpusnap.yaml") as f:
            manifest = [d for d in yaml.safe_load_all(f) if d]
        self.assertEqual(containers(manifest)[1]["agent"]["args"],
                         containers(render())[1]["agent"]["args"])

    def test_controller_probe_waits_at_least_three_polls(self):
        for values, limit in ((["controller.pollMillis=2000"], 120),
                              (["controller.pollMillis=600000"], 1800)):
            _, c = containers(render(*values))
            command = c["controller"]["livenessProbe"]["exec"]["command"]
            self.assertTrue(command[-1].endswith(f"-lt {limit}"), command)


def wait_stopped(pid, seconds=10):
    """Whether every thread of `pid` is stopped (state T) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # a thread that ended meanwhile
        if states and all(st in ("T", "t") for st in states):
            return True
        time.sleep(0.01)
    return False


def free_port_socket(path):
    """A Unix socket that accepts connections and never answers: a hung agent."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.listen(8)
    return s


@unittest.skipUnless(os.environ.get("GPUSNAP_CLI") and os.environ.get("GPUSNAP_AGENT") and
                     os.environ.get("GPUSNAP_CONTROLLER"),
                     "GPUSNAP_CLI, GPUSNAP_AGENT, GPUSNAP_CONTROLLER (this build's programs) unset;"
                     " ctest sets them")
class ProbesTest(unittest.TestCase):
    """The rendered probe commands, run against the real programs of this build."""

    def setUp(self):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="gpusnap-probes-"))
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def start(self, args):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

        def end():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
            p.wait(timeout=30)
            p.stderr.close()
        self.addCleanup(end)
        return p

    def probe(self, container, kind, replace):
        """The rendered probe's command with the paths of this test, and its timeout."""
        _, c = containers(render("controller.pollMillis=1000", "controller.staleSeconds=10"))
        probe = c[container][kind]
        command = probe["exec"]["command"]
        for old, new in replace.items():
            # A program name replaces a whole word; a path also inside a shell command.
            command = [new if a == old else a.replace(old, new) if "/" in old else a
                       for a in command]
        return command, probe["timeoutSeconds"]

    def run_probe(self, command, timeout):
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None  # the kubelet counts a probe past its timeout as failed

    def test_agent_probes_ask_the_agent_and_fail_when_it_does_not_answer(self):
        if os.geteuid() != 0:
            self.skipTest("gpusnap-agent runs as root only")
        sock = self.dir / "agent.sock"
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            command, timeout = self.probe("agent", kind, {"gpusnap": os.environ["GPUSNAP_CLI"],
                                                          "/run/gpusnap/agent.sock": str(sock)})
            self.assertEqual(command[1:], ["--agent", str(sock), "version"])
        # Nothing there: refused.
        r = self.run_probe(command, timeout)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(str(sock), r.stderr)
        # A socket that accepts and never answers (a hung agent): past the probe's timeout.
        hung = free_port_socket(sock)
        self.assertIsNone(self.run_probe(command, timeout))
        hung.close()
        sock.unlink()
        # The real agent: answers with its version and node.
        agent = self.start([os.environ["GPUSNAP_AGENT"], "--socket", str(sock),
                            "--storage", str(self.dir / "snapshots"),
                            "--state-dir", str(self.dir / "state"),
                            "--run-dir", str(self.dir / "run")])
        deadline = time.monotonic() + 30
        while not sock.exists() and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertIsNone(agent.poll(), agent.stderr.read() if agent.poll() is not None else "")
        r = self.run_probe(command, timeout)
        self.assertIsNotNone(r)
        self.assertEqual(r.returncode, 0, r.stderr)
        version = subprocess.run([os.environ["GPUSNAP_CLI"], "version"], capture_output=True,
                                 text=True, check=True).stdout.split()[1]
        self.assertRegex(r.stdout, rf"^gpusnap {version}\nagent {version} on node \S+ \({sock}\)\n$")
        # A stopped agent (SIGSTOP: the process and its socket still there) fails the probe.
        # kill() returns before every thread has stopped: on a loaded machine a thread could
        # still answer, so the probe runs once all of them are stopped.
        agent.send_signal(signal.SIGSTOP)
        self.assertTrue(wait_stopped(agent.pid), f"agent {agent.pid} did not stop")
        self.assertIsNone(self.run_probe(command, timeout))
        agent.send_signal(signal.SIGCONT)
        r = self.run_probe(command, timeout)
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_agent_reads_keys_from_a_secret_mount_and_refuses_them_readable_by_others(self):
        if os.geteuid() != 0:
            self.skipTest("gpusnap-agent runs as root only")
        pod, c = containers(render(*ENCRYPTED))
        args = c["agent"]["args"]
        key_dir = next(a.split("=", 1)[1] for a in args if a.startswith("--decryption-key="))
        volume = next(v for v in pod["volumes"] if v["name"] == "decryption-keys")
        # A Secret's mount as the kubelet lays it out: KEY -> ..data/KEY, files at defaultMode.
        mount = self.dir / "keys"
        data = mount / "..2026_12_05_00_00_00.000000000"
        data.mkdir(parents=True)
        subprocess.run(["openssl", "genpkey", "-algorithm", "X25519", "-out", data / "node.pem"],
                       check=True, capture_output=True)
        (mount / "..data").symlink_to(data.name)
        (mount / "node.pem").symlink_to("..data/node.pem")
        pem = (data / "node.pem").read_text()
        fingerprint = "sha256:" + hashlib.sha256(subprocess.run(
            ["openssl", "pkey", "-in", data / "node.pem", "-pubout", "-outform", "DER"],
            check=True, capture_output=True).stdout).hexdigest()

        def agent(mode):
            os.chmod(data / "node.pem", mode)
            sock = self.dir / f"agent-{mode:o}.sock"
            return sock, self.start([
                os.environ["GPUSNAP_AGENT"], "--socket", str(sock),
                "--storage", str(self.dir / "snapshots"), "--state-dir", str(self.dir / "state"),
                "--run-dir", str(self.dir / "run"), "--registry", "oci://127.0.0.1:9/gpusnap/x",
                "--cache", str(self.dir / "cache"),
                args[args.index(f"--decryption-key={key_dir}")].replace(key_dir, str(mount))])

        # As the chart mounts it: for root alone. The agent serves, naming the key by file and
        # fingerprint, never by its bytes.
        self.assertEqual(volume["secret"]["defaultMode"], 0o400)
        sock, p = agent(volume["secret"]["defaultMode"])
        deadline = time.monotonic() + 30
        while not sock.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertIsNone(p.poll(), p.stderr.read() if p.poll() is not None else "")
        p.terminate()
        p.wait(timeout=30)
        log = p.stderr.read()
        self.assertIn(f"decryption keys {mount / 'node.pem'} ({fingerprint})", log)
        body = "".join(pem.splitlines()[1:-1])
        self.assertNotIn(body[:24], log)
        self.assertNotIn("PRIVATE KEY", log)

        # Mounted readable by everyone (defaultMode 0444, the kubelet's own default is 0644):
        # refused before the agent serves, exit 12, one line naming the file and the fix.
        _, p = agent(0o444)
        self.assertEqual(p.wait(timeout=30), 12)
        err = p.stderr.read()
        self.assertIn(f"decryption key {mount / 'node.pem'} is readable by its group or others "
                      "(mode 0444): a key others can read is no secret (fix: chmod 600 "
                      f"{mount / 'node.pem'}", err)
        self.assertNotIn(body[:24], err)

    def test_controller_probe_reads_the_worker_loops_heartbeat(self):
        alive = self.dir / "alive"
        command, timeout = self.probe("controller", "livenessProbe",
                                      {"/var/run/gpusnap-controller/alive": str(alive)})
        _, c = containers(render())
        self.assertIn("--alive-file=/var/run/gpusnap-controller/alive", c["controller"]["args"])
        mount = {m["name"]: m["mountPath"] for m in c["controller"]["volumeMounts"]}
        self.assertEqual(mount["controller-alive"], "/var/run/gpusnap-controller")
        # No file yet: not alive.
        self.assertNotEqual(self.run_probe(command, timeout).returncode, 0)
        # The real controller, its API server unreachable: the loop still turns (it waits for
        # the first lists), so it is alive -- a restart would not reach the server either.
        token = self.dir / "token"
        token.write_text("t\n")
        controller = self.start([os.environ["GPUSNAP_CONTROLLER"], "--node", "node-a",
                                 "--api-server", "http://127.0.0.1:9", "--token-file", str(token),
                                 "--poll-ms", "1000", "--alive-file", str(alive)])
        deadline = time.monotonic() + 10
        while not alive.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        r = self.run_probe(command, timeout)
        self.assertEqual(r.returncode, 0, r.stderr)
        # A loop that stops turning (SIGSTOP) goes stale after staleSeconds (10 here).
        controller.send_signal(signal.SIGSTOP)
        time.sleep(11)
        self.assertNotEqual(self.run_probe(command, timeout).returncode, 0)
        controller.send_signal(signal.SIGCONT)
        time.sleep(1.5)
        self.assertEqual(self.run_probe(command, timeout).returncode, 0)


if __name__ == "__main__":
    if not HELM.is_file():
        print(f"skipped: helm not installed ({HELM}; scripts/install-k8s-tools)")
        sys.exit(77)
    unittest.main()
