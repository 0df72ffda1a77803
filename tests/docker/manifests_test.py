#!/usr/bin/python3
"""The deployment files in docker/ hold together, checked without a cluster.

- docker/k8s/*.yaml: every document against the Kubernetes API's own types
  (Debian's python3-kubernetes, generated from the API's OpenAPI spec): no
  field the API does not have, every value of its type, required fields
  present; then what ties them together: the StatefulSet's serviceName is the
  headless Service, selectors match the pods' labels, the Service's ports are
  the container's, the probes exist, a GPU is requested, Prometheus's
  annotations name the metrics port, every file the pods read from the
  Secret is one of its keys.
- docker/k8s and docker/compose.yaml: every KVCACHED_<FLAG> variable names a
  flag that `kvcached --helpfull` lists (docker/entrypoint.sh turns them into
  flags; a misspelt one would stop the server at start).

podman 4.3's `kube play` runs Pods and Deployments, not StatefulSets,
Services or PodDisruptionBudgets, hence this check.

  /usr/bin/python3 tests/docker/manifests_test.py --kvcached build/server/kvcached \\
      --docker_dir docker
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import unittest

import kubernetes.client
import yaml

ARGS = None

KINDS = {
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("v1", "Service"): "V1Service",
    ("v1", "Secret"): "V1Secret",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
}


def check_type(value, type_name, path, errors):
    """Appends to `errors` where `value` is not of the API's `type_name`."""
    if type_name.startswith("list["):
        if not isinstance(value, list):
            errors.append("%s: a list expected" % path)
            return
        for i, item in enumerate(value):
            check_type(item, type_name[5:-1], "%s[%d]" % (path, i), errors)
    elif type_name.startswith("dict("):
        if not isinstance(value, dict):
            errors.append("%s: a map expected" % path)
            return
        inner = type_name[5:-1].split(", ", 1)[1]
        for key, item in value.items():
            check_type(item, inner, "%s.%s" % (path, key), errors)
    elif type_name == "str":
        if not isinstance(value, str):
            errors.append("%s: a string expected, not %r" % (path, value))
    elif type_name == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append("%s: an integer expected, not %r" % (path, value))
    elif type_name == "bool":
        if not isinstance(value, bool):
            errors.append("%s: true or false expected, not %r" % (path, value))
    elif type_name in ("object", "datetime", "float"):
        pass  # IntOrString and the like: any scalar
    else:
        model = getattr(kubernetes.client, type_name)
        if not isinstance(value, dict):
            errors.append("%s: an object (%s) expected" % (path, type_name))
            return
        fields = {wire: attribute for attribute, wire in model.attribute_map.items()}
        for key, item in value.items():
            if key not in fields:
                errors.append("%s: %s has no field %r" % (path, type_name, key))
                continue
            check_type(item, model.openapi_types[fields[key]], "%s.%s" % (path, key), errors)


class _Response:
    def __init__(self, document):
        self.data = json.dumps(document)


def kvcached_flags():
    text = subprocess.run([ARGS.kvcached, "--helpfull"], capture_output=True, text=True).stdout
    return set(re.findall(r"^\s+--([a-z_0-9]+) ", text, re.MULTILINE))


def flag_variables(environment):
    """The KVCACHED_* names of an env list ([{name, value}]) or map."""
    names = environment.keys() if isinstance(environment, dict) else [e["name"] for e in environment]
    return [n for n in names if n.startswith("KVCACHED_") and not n.startswith("KVCACHED_PROBE_")]


class KubernetesManifestsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.documents = {}
        for path in sorted(glob.glob(os.path.join(ARGS.docker_dir, "k8s", "*.yaml"))):
            with open(path) as f:
                for document in yaml.safe_load_all(f):
                    if document:
                        cls.documents[document["kind"]] = (os.path.basename(path), document)

    def test_every_document_is_of_the_api_types(self):
        self.assertEqual(set(k for _, k in KINDS), set(self.documents))
        client = kubernetes.client.ApiClient()
        for kind, (path, document) in self.documents.items():
            model = KINDS[(document["apiVersion"], kind)]
            errors = []
            check_type(document, model, path, errors)
            self.assertEqual(errors, [], "%s does not fit the Kubernetes API" % path)
            # Required fields: the generated models refuse to be built without them.
            client.deserialize(_Response(document), model)

    def test_the_statefulset_service_and_budget_agree(self):
        sts = self.documents["StatefulSet"][1]
        service = self.documents["Service"][1]
        budget = self.documents["PodDisruptionBudget"][1]
        pod = sts["spec"]["template"]
        labels = pod["metadata"]["labels"]
        self.assertEqual(sts["spec"]["serviceName"], service["metadata"]["name"])
        self.assertEqual(service["spec"]["clusterIP"], "None", "stable names need a headless Service")
        for selector in (sts["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                         budget["spec"]["selector"]["matchLabels"]):
            for key, value in selector.items():
                self.assertEqual(labels.get(key), value)
        container = pod["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            self.assertIn(port["targetPort"], ports)
            self.assertEqual(port["port"], ports[port["targetPort"]])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            self.assertIn(probe, container)
        self.assertIn("nvidia.com/gpu", container["resources"]["requests"])
        annotations = pod["metadata"]["annotations"]
        self.assertEqual(annotations["prometheus.io/scrape"], "true")
        self.assertEqual(int(annotations["prometheus.io/port"]), ports["metrics"])
        self.assertTrue(pod["spec"]["securityContext"]["runAsNonRoot"])

    def test_the_pods_read_only_keys_the_secret_has(self):
        sts = self.documents["StatefulSet"][1]
        secret = self.documents["Secret"][1]
        container = sts["spec"]["template"]["spec"]["containers"][0]
        mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "secret")
        keys = set(secret["stringData"])
        read = [v for e in container["env"] for v in re.findall(re.escape(mount) + r"/([\w.-]+)",
                                                                  e.get("value", ""))]
        self.assertTrue(read)
        for key in read:
            self.assertIn(key, keys)

    def test_only_the_router_reaches_the_kv_event_ports(self):
        policy = self.documents["NetworkPolicy"][1]["spec"]
        container = self.documents["StatefulSet"][1]["spec"]["template"]["spec"]["containers"][0]
        named = {p["name"] for p in container["ports"]}
        opened = {}
        for rule in policy["ingress"]:
            for port in rule["ports"]:
                self.assertIn(port["port"], named, "the policy names a port the pods lack")
                opened[port["port"]] = rule.get("from")
        self.assertEqual(set(opened), named, "every port of the pods has a rule")
        for port in ("kv-events", "kv-replay"):
            self.assertEqual(opened[port], [{"podSelector": {"matchLabels": {
                "app.kubernetes.io/component": "kv-router"}}}], port)
        self.assertIsNone(opened["grpc"])

    def test_every_kvcached_variable_is_a_flag(self):
        flags = kvcached_flags()
        self.assertIn("pool_bytes", flags)
        container = self.documents["StatefulSet"][1]["spec"]["template"]["spec"]["containers"][0]
        for name in flag_variables(container["env"]):
            self.assertIn(name[len("KVCACHED_"):].lower(), flags, name)


class ComposeTest(unittest.TestCase):
    def test_three_replicas_each_with_its_volume_and_ports(self):
        with open(os.path.join(ARGS.docker_dir, "compose.yaml")) as f:
            compose = yaml.safe_load(f)
        services = compose["services"]
        self.assertEqual(len(services), 3)
        flags = kvcached_flags()
        published = set()
        for name, service in services.items():
            self.assertEqual(len(service["volumes"]), 1)
            volume = service["volumes"][0].split(":")[0]
            self.assertIn(volume, compose["volumes"])
            for port in service["ports"]:
                host = ":".join(port.split(":")[:2])
                self.assertNotIn(host, published, "two replicas publish " + host)
                published.add(host)
            for variable in flag_variables(service["environment"]):
                self.assertIn(variable[len("KVCACHED_"):].lower(), flags, variable)
            lane = service["environment"]["KVCACHED_DATA_LANE_ADVERTISE"]
            self.assertTrue(any(p.startswith(lane + ":") for p in service["ports"]),
                            "%s advertises its lane at a port it publishes" % name)


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvcached", required=True)
    parser.add_argument("--docker_dir", required=True)
    ARGS, rest = parser.parse_known_args()
    program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
    sys.exit(0 if program.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
