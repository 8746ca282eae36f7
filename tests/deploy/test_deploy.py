#!/usr/bin/env python3
"""Checks deploy/: every YAML file parses, the CRD is a structural v1 schema with the status
subresource, printer columns and conventional conditions, the RBAC rules are exactly what the
controller calls, the DaemonSet carries the privileges and mounts the agent needs, and the Helm
chart refers only to values it defines. Helm itself is not installed here, so the chart's
templates are checked as text, not rendered."""

import os
import pathlib
import re
import subprocess
import unittest

import yaml

ROOT = pathlib.Path(os.environ.get("GPUSNAP_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "gpusnap"


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def by_kind(docs, kind):
    found = [d for d in docs if d.get("kind") == kind]
    assert found, f"no {kind}"
    return found


def walk_schema(schema, path, problems):
    """Structural schema rules: every node has a type (or preserves unknown fields), no
    additionalProperties beside properties, and oneOf/anyOf only hold value validations."""
    if "type" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields") \
            and not schema.get("x-kubernetes-int-or-string"):
        problems.append(f"{path}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{path}: properties and additionalProperties")
    for junction in ("oneOf", "anyOf", "allOf"):
        for i, sub in enumerate(schema.get(junction, [])):
            for k in sub:
                if k in ("type", "properties", "items", "default", "description"):
                    problems.append(f"{path}.{junction}[{i}]: {k} is not allowed in a junction")
    for name, sub in schema.get("properties", {}).items():
        walk_schema(sub, f"{path}.{name}", problems)
    if "items" in schema:
        walk_schema(schema["items"], f"{path}[]", problems)


class DeployTest(unittest.TestCase):
    def test_every_yaml_file_parses(self):
        files = [p for p in DEPLOY.rglob("*.yaml") if "templates" not in p.parts]
        self.assertGreaterEqual(len(files), 7)
        for p in files:
            with self.subTest(file=str(p.relative_to(ROOT))):
                self.assertTrue(load_all(p))

    def test_crd_is_structural_with_status_and_conditions(self):
        (crd,) = load_all(DEPLOY / "crds" / "gpusnap.io_gpusnapshots.yaml")
        self.assertEqual(crd["apiVersion"], "apiextensions.k8s.io/v1")
        self.assertEqual(crd["metadata"]["name"], "gpusnapshots.gpusnap.io")
        spec = crd["spec"]
        self.assertEqual((spec["group"], spec["scope"], spec["names"]["kind"]),
                         ("gpusnap.io", "Namespaced", "GpuSnapshot"))
        (version,) = spec["versions"]
        self.assertEqual(version["name"], "v1alpha1")
        self.assertTrue(version["served"] and version["storage"])
        self.assertEqual(version["subresources"], {"status": {}})
        columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
        self.assertEqual(columns["Phase"], ".status.phase")
        self.assertEqual(columns["Node"], ".status.nodeName")
        schema = version["schema"]["openAPIV3Schema"]
        problems = []
        walk_schema(schema, "", problems)
        self.assertEqual(problems, [])
        source = schema["properties"]["spec"]["properties"]["source"]
        self.assertEqual(source["oneOf"], [{"required": ["podName"]}, {"required": ["template"]}])
        conditions = schema["properties"]["status"]["properties"]["conditions"]
        self.assertEqual(conditions["x-kubernetes-list-map-keys"], ["type"])
        item = conditions["items"]
        self.assertEqual(set(item["properties"]),
                         {"type", "status", "reason", "message", "lastTransitionTime",
                          "observedGeneration"})
        self.assertEqual(item["properties"]["status"]["enum"], ["True", "False", "Unknown"])
        # Every status field the controller writes is in the schema (a CRD prunes the rest).
        source_text = (ROOT / "src" / "kube" / "controller.cc").read_text()
        written = set(re.findall(r'st\["(\w+)"\]|s\["(\w+)"\]', source_text))
        written = {a or b for a, b in written}
        self.assertTrue(written)
        self.assertLessEqual(written, set(schema["properties"]["status"]["properties"]), written)
        for reason in re.findall(r'"((?:[A-Z][a-z]+)+)"', source_text):
            self.assertRegex(reason, item["properties"]["reason"]["pattern"])

    def test_chart_ships_the_same_crd(self):
        self.assertEqual((DEPLOY / "crds" / "gpusnap.io_gpusnapshots.yaml").read_text(),
                         (CHART / "crds" / "gpusnap.io_gpusnapshots.yaml").read_text())

    def test_rbac_is_what_the_controller_calls(self):
        docs = load_all(DEPLOY / "manifests" / "gpusnap.yaml")
        (role,) = by_kind(docs, "ClusterRole")
        rules = {(r["apiGroups"][0], res): sorted(r["verbs"])
                 for r in role["rules"] for res in r["resources"]}
        self.assertEqual(rules, {
            ("gpusnap.io", "gpusnapshots"): ["get", "list", "watch"],
            ("gpusnap.io", "gpusnapshots/status"): ["get", "update"],
            ("", "pods"): ["create", "delete", "get", "list", "patch", "watch"],
            ("", "pods/status"): ["update"],
            ("", "events"): ["create"],
        })
        (binding,) = by_kind(docs, "ClusterRoleBinding")
        (sa,) = by_kind(docs, "ServiceAccount")
        self.assertEqual(binding["subjects"][0]["name"], sa["metadata"]["name"])
        self.assertEqual(binding["roleRef"]["name"], role["metadata"]["name"])

    def test_daemonset_has_what_the_agent_needs(self):
        (ds,) = by_kind(load_all(DEPLOY / "manifests" / "gpusnap.yaml"), "DaemonSet")
        pod = ds["spec"]["template"]["spec"]
        self.assertTrue(pod["hostPID"])
        self.assertEqual(pod["runtimeClassName"], "nvidia")
        self.assertEqual(ds["spec"]["selector"]["matchLabels"],
                         {k: v for k, v in ds["spec"]["template"]["metadata"]["labels"].items()
                          if k in ds["spec"]["selector"]["matchLabels"]})
        containers = {c["name"]: c for c in pod["containers"]}
        agent, controller = containers["agent"], containers["controller"]
        self.assertTrue(agent["securityContext"]["privileged"])
        self.assertEqual(controller["securityContext"]["capabilities"]["drop"], ["ALL"])
        self.assertIn("--node=$(NODE_NAME)", controller["args"])
        env = {e["name"]: e for e in agent["env"]}
        self.assertEqual(env["NVIDIA_VISIBLE_DEVICES"]["value"], "all")
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"] + pod["initContainers"]:
            for m in c["volumeMounts"]:
                self.assertIn(m["name"], volumes, f"{c['name']} mounts an undeclared volume")
        mounts = {m["mountPath"] for m in agent["volumeMounts"]}
        self.assertLessEqual({"/run/gpusnap", "/var/lib/gpusnap/snapshots", "/run/containerd",
                              "/sys/fs/cgroup"}, mounts)
        self.assertEqual(volumes["host-bin"]["hostPath"]["path"], "/opt/gpusnap/bin")
        self.assertEqual([c["name"] for c in pod["initContainers"]], ["install"])

    def test_examples_use_the_controllers_names(self):
        snap = load_all(DEPLOY / "examples" / "snapshot-of-pod.yaml")[0]
        self.assertEqual(snap["apiVersion"], "gpusnap.io/v1alpha1")
        (deploy,) = load_all(DEPLOY / "examples" / "restored-deployment.yaml")
        tmpl = deploy["spec"]["template"]
        self.assertIn("gpusnap.io/snapshot", tmpl["metadata"]["annotations"])
        self.assertEqual(tmpl["spec"]["readinessGates"], [{"conditionType": "gpusnap.io/restored"}])
        self.assertEqual(tmpl["spec"]["containers"][0]["command"][1:], ["init", "--placeholder"])

    def test_chart_templates_use_only_defined_values(self):
        chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
        self.assertEqual(chart["apiVersion"], "v2")
        values = yaml.safe_load((CHART / "values.yaml").read_text())
        for p in (CHART / "templates").iterdir():
            text = p.read_text()
            with self.subTest(template=p.name):
                self.assertEqual(text.count("{{"), text.count("}}"))
                opens = len(re.findall(r"{{-?\s*(?:if|with|range|define)\b", text))
                ends = len(re.findall(r"{{-?\s*end\b", text))
                self.assertEqual(opens, ends)
                for ref in re.findall(r"\.Values((?:\.\w+)+)", text):
                    node = values
                    for part in ref.strip(".").split("."):
                        self.assertIn(part, node, f".Values{ref} is not in values.yaml")
                        node = node[part]

    def test_chart_oci_storage_becomes_the_agents_registry_flags(self):
        values = yaml.safe_load((CHART / "values.yaml").read_text())
        text = (CHART / "templates" / "daemonset.yaml").read_text()
        # The flags gpusnap-agent takes, from its own --help (the build's binary, named by ctest).
        agent = os.environ.get("GPUSNAP_AGENT")
        if not agent:
            self.skipTest("GPUSNAP_AGENT (the gpusnap-agent binary) is not set; ctest sets it")
        help_text = subprocess.run([agent, "--help"], capture_output=True, text=True,
                                   check=True).stdout
        agent_flags = set(re.findall(r"^\s+(?:-\w, )?(--[a-z-]+)", help_text, re.M))
        self.assertIn("--registry-ca-file", agent_flags, help_text)
        # Every flag the template gives the agent is one gpusnap-agent takes.
        args = text[text.index('command: ["gpusnap-agent"]'):text.index("env:")]
        given = set(re.findall(r"- (--[a-z-]+)", args))
        self.assertLessEqual({"--registry", "--registry-auth-file", "--registry-ca-file",
                              "--registry-plain-http", "--cache", "--cache-budget-mib"}, given)
        self.assertLessEqual(given, agent_flags, given - agent_flags)
        # Every oci value reaches the template.
        def leaves(node, path):
            for k, v in node.items():
                yield from leaves(v, f"{path}.{k}") if isinstance(v, dict) else [f"{path}.{k}"]
        for leaf in leaves(values["storage"]["oci"], ".Values.storage.oci"):
            self.assertIn(leaf, text)
        # The credentials and the CA are mounted read-only, for root alone.
        for name in ("registry-auth", "registry-ca"):
            volume = text[text.index(f"- name: {name}\n          secret:"):]
            self.assertIn("defaultMode: 0400", volume[:volume.index("{{- end }}")])
            mount = text[text.index(f"- name: {name}\n              mountPath:"):]
            self.assertIn("readOnly: true", mount[:mount.index("{{- end }}")])
        # The example values are the chart's own.
        example = yaml.safe_load((DEPLOY / "examples" / "values-oci.yaml").read_text())
        self.assertEqual(example["storage"]["type"], "oci")
        for leaf in leaves(example["storage"]["oci"], ""):
            node = values["storage"]["oci"]
            for part in leaf.strip(".").split("."):
                self.assertIn(part, node, leaf)
                node = node[part]


if __name__ == "__main__":
    unittest.main()
