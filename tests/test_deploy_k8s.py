"""Kubernetes manifests: the Kubernetes schemas offline, the LeaderWorkerSet structure, and commands, env, ports
and network policies against the CLI."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import yaml

from .deploy_checks import (
    K8S,
    K8S_VERSION,
    LWS_ENV,
    SAMPLE_POD_IP,
    check_invocation,
    k8s_docs,
    k8s_pod_templates,
    settings,
)

# ---------------------------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------------------------

def k8s_errors(doc: dict) -> str | None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{'.'.join(map(str, e.path))}: {e.message}"
    return None


def test_every_manifest_validates_against_the_kubernetes_schemas():
    kinds = set()
    for name, d in k8s_docs():
        kinds.add(d["kind"])
        if d["kind"] == "LeaderWorkerSet":
            continue  # a CRD: its pod templates are checked below, the rest structurally
        assert k8s_errors(d) is None, (name, d["kind"], k8s_errors(d))
    assert {"ConfigMap", "Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget", "LeaderWorkerSet"} <= kinds


def test_leaderworkerset_structure_and_pod_templates():
    lws = [d for _, d in k8s_docs() if d["kind"] == "LeaderWorkerSet"]
    assert len(lws) == 1
    d = lws[0]
    assert d["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and set(d) == {"apiVersion", "kind", "metadata", "spec"}
    spec = d["spec"]
    assert set(spec) <= {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
    assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
    assert spec.get("startupPolicy", "LeaderCreated") in ("LeaderCreated", "LeaderReady")
    lwt = spec["leaderWorkerTemplate"]
    assert set(lwt) <= {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy"}
    assert "workerTemplate" in lwt and isinstance(lwt["size"], int) and lwt["size"] >= 1
    assert lwt.get("restartPolicy", "RecreateGroupOnPodRestart") in ("RecreateGroupOnPodRestart", "None")
    ro = spec.get("rolloutStrategy", {})
    assert set(ro) <= {"type", "rollingUpdateConfiguration"} and ro.get("type", "RollingUpdate") == "RollingUpdate"
    assert set(ro.get("rollingUpdateConfiguration", {})) <= {"maxUnavailable", "maxSurge", "partition"}
    for key in ("leaderTemplate", "workerTemplate"):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key.lower()},
                   "template": lwt[key]}
        assert k8s_errors(wrapped) is None, (key, k8s_errors(wrapped))


def test_kubernetes_validation_rejects_mistakes():
    dep = next(d for _, d in k8s_docs() if d["kind"] == "Deployment")
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ready"
    assert k8s_errors(bad)
    bad = copy.deepcopy(dep)
    bad["spec"]["replicas"] = "one"
    assert k8s_errors(bad)
    lws = next(d for _, d in k8s_docs() if d["kind"] == "LeaderWorkerSet")
    tmpl = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"]["workerTemplate"])
    tmpl["spec"]["containers"][0]["envFrom"][0]["configMap"] = tmpl["spec"]["containers"][0]["envFrom"][0].pop(
        "configMapRef")
    assert k8s_errors({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": tmpl})


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert sorted(k["resources"]) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")
    images = {i["name"] for i in k.get("images", [])}
    for _, _, pod in k8s_pod_templates():
        for c in pod["spec"]["containers"]:
            assert c["image"].split(":")[0] in images


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container_invocation(owner: dict, container: dict, configmaps: dict[str, dict]) -> tuple[list, dict, list]:
    """(argv, env, problems) for a container: envFrom ConfigMaps, env values, $(VAR) references expanded."""
    problems, env = [], {}
    injected = LWS_ENV if owner["kind"] == "LeaderWorkerSet" else {}
    for src in container.get("envFrom", []):
        name = src.get("configMapRef", {}).get("name")
        if name not in configmaps:
            problems.append(f"envFrom ConfigMap {name!r} is not in the manifests")
            continue
        env.update({str(k): str(v) for k, v in configmaps[name].get("data", {}).items()})
    for e in container.get("env", []):
        if "value" in e:
            def ref(m):
                if m.group(1) not in {**injected, **env}:
                    problems.append(f"{e['name']} refers to $({m.group(1)}), which is not defined")
                return {**injected, **env}.get(m.group(1), "")
            env[e["name"]] = re.sub(r"\$\((\w+)\)", ref, str(e["value"]))
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = SAMPLE_POD_IP
        else:
            env[e["name"]] = "from-a-secret"
    if container.get("command") not in (None, ["dspark-pd"]):
        problems.append(f"command {container['command']} overrides the image's dspark-pd entrypoint")
    return list(container.get("args", [])), env, problems


def check_k8s(docs: list[tuple[str, dict]]) -> list[str]:
    """Problems with the manifests: commands/env against the CLI, and ports, probes, Services, policies."""
    problems = []
    by_kind: dict[str, list[dict]] = {}
    for _, d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    configmaps = {d["metadata"]["name"]: d for d in by_kind.get("ConfigMap", [])}
    pods = []  # (where, labels, container, argv, cfg)
    for where, owner, tmpl in k8s_pod_templates(docs):
        for c in tmpl["spec"]["containers"]:
            argv, env, found = container_invocation(owner, c, configmaps)
            found += check_invocation(argv, env)
            problems += [f"{where}/{c['name']}: {p}" for p in found]
            if found:
                continue
            cfg = settings(argv, env)
            pods.append((where, tmpl["metadata"].get("labels", {}), c, argv, cfg, env))
            res = c.get("resources", {})
            if str(res.get("limits", {}).get("nvidia.com/gpu")) != "1" or "memory" not in res.get("limits", {}) \
                    or "memory" not in res.get("requests", {}):
                problems.append(f"{where}: needs nvidia.com/gpu: 1 and memory requests/limits")
            if env.get("DSPARK_HOST") != SAMPLE_POD_IP:
                problems.append(f"{where}: DSPARK_HOST must be the pod IP (Mooncake advertises it)")
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            if argv[0] == "serve-prefill":
                if owner["kind"] == "LeaderWorkerSet":
                    want = {"RANK": LWS_ENV["LWS_WORKER_INDEX"], "WORLD_SIZE": LWS_ENV["LWS_GROUP_SIZE"],
                            "MASTER_ADDR": LWS_ENV["LWS_LEADER_ADDRESS"], "MASTER_PORT": str(cfg.master_port)}
                    if {k: env.get(k) for k in want} != want:
                        problems.append(f"{where}: rendezvous env {({k: env.get(k) for k in want})} != {want}")
                if "workerTemplate" not in where:  # rank 0 (or all of the stages in one pod) serves gRPC
                    if ports.get("grpc") != cfg.port or (cfg.metrics_port and ports.get("metrics") != cfg.metrics_port):
                        problems.append(f"{where}: container ports {ports} != gRPC {cfg.port} / metrics")
                    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                        if c.get(probe, {}).get("grpc", {}).get("port") != cfg.port:
                            problems.append(f"{where}: {probe} is not a gRPC probe on port {cfg.port}")
            else:
                if ports.get("http") != cfg.port:
                    problems.append(f"{where}: container port http {ports.get('http')} != DSPARK_PORT {cfg.port}")
                for probe, path in (("startupProbe", "/health"), ("readinessProbe", "/ready"),
                                    ("livenessProbe", "/health")):
                    get = c.get(probe, {}).get("httpGet", {})
                    if get.get("path") != path or get.get("port") not in ("http", cfg.port):
                        problems.append(f"{where}: {probe} should GET {path} on the HTTP port")
            mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
            model = [m for m in mounts.values() if m["mountPath"] == cfg.model]
            if not model or not model[0].get("readOnly"):
                problems.append(f"{where}: the model directory {cfg.model} is not mounted read-only")
    # Services select pods that serve the named port
    for svc in by_kind.get("Service", []):
        chosen = [p for p in pods if selects(svc["spec"]["selector"], p[1])]
        if not chosen:
            problems.append(f"Service {svc['metadata']['name']} selects no pod")
        for sp in svc["spec"]["ports"]:
            for where, _, c, _, _, _ in chosen:
                named = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
                tp = sp.get("targetPort", sp["port"])
                if (tp not in named) if isinstance(tp, str) else (tp not in named.values()):
                    problems.append(f"Service {svc['metadata']['name']} port {tp} is not served by {where}")
    # the decode service's prefill peers are the prefill gRPC Service
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    lws_names = {d["metadata"]["name"] for d in by_kind.get("LeaderWorkerSet", [])}
    for where, _, _, argv, cfg, _ in pods:
        if argv[0] != "serve-decode":
            continue
        for peer in cfg.peers:
            host, _, port = peer.rpartition(":")
            svc = services.get(host.split(".")[0])
            prefill_ports = {p[4].port for p in pods if p[3][0] == "serve-prefill"}
            if svc is None and host.split(".")[-1] not in lws_names:
                problems.append(f"{where}: prefill peer {peer} is neither a Service nor an LWS leader")
            if int(port) not in prefill_ports:
                problems.append(f"{where}: prefill peer port {port} is not the prefill gRPC port {prefill_ports}")
            if svc is not None and svc["spec"].get("clusterIP") != "None":
                problems.append(f"{where}: the prefill Service {host} should be headless")
    # NetworkPolicies: each pod is covered; gRPC and Mooncake open only to the pair, the API to all
    policies = by_kind.get("NetworkPolicy", [])
    pair = [p[1] for p in pods]
    for where, labels, _, argv, cfg, env in pods:
        mine = [np for np in policies if selects(np["spec"]["podSelector"].get("matchLabels", {}), labels)]
        if not mine:
            problems.append(f"{where}: no NetworkPolicy selects it")
            continue
        lo, hi = int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])
        private = [(lo, hi)] + ([(cfg.port, cfg.port)] if argv[0] == "serve-prefill" else [])
        for rule in (r for np in mine for r in np["spec"].get("ingress", [])):
            peers = rule.get("from")
            only_pair = peers is not None and all(
                "podSelector" in p and "namespaceSelector" not in p and
                any(selects(p["podSelector"].get("matchLabels", {}), lab) for lab in pair) for p in peers)
            rule_ports = [(p["port"], p.get("endPort", p["port"])) for p in rule.get("ports", [])] or [(1, 65535)]
            for a, b in private:
                if not only_pair and any(x <= b and a <= y for x, y in rule_ports):
                    problems.append(f"{where}: ports {a}-{b} are open beyond the pair ({rule})")
        opened = [(p["port"], p.get("endPort", p["port"])) for np in mine for r in np["spec"].get("ingress", [])
                  for p in r.get("ports", [])]
        for a, b in private + ([(cfg.port, cfg.port)] if argv[0] == "serve-decode" else []):
            if not any(x <= a and b <= y for x, y in opened):
                problems.append(f"{where}: ports {a}-{b} are not opened by its NetworkPolicy")
    # PodDisruptionBudgets cover both halves
    for half in ("serve-prefill", "serve-decode"):
        labels = [p[1] for p in pods if p[3][0] == half]
        if not any(selects(pdb["spec"]["selector"]["matchLabels"], lab) for pdb in by_kind.get(
                "PodDisruptionBudget", []) for lab in labels):
            problems.append(f"{half}: no PodDisruptionBudget")
    return problems


def test_k8s_commands_env_ports_and_policies_match_the_cli():
    assert check_k8s(k8s_docs()) == []


def mutate(docs, kind, name, fn):
    docs = copy.deepcopy(docs)
    for _, d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            fn(d)
    return docs


def test_k8s_checker_catches_mistakes():
    docs = k8s_docs()

    def lws_leader(d):
        return d["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]

    cases = [
        (mutate(docs, "ConfigMap", "dspark-prefill-config", lambda d: d["data"].update(DSPARK_PIPELINE="2")),
         "DSPARK_PIPELINE"),
        (mutate(docs, "ConfigMap", "dspark-decode-config", lambda d: d["data"].update(DSPARK_PROTOCOL="udp")),
         "udp"),
        (mutate(docs, "ConfigMap", "dspark-prefill-config", lambda d: d["data"].update(DSPARK_PORT="50052")),
         "gRPC probe on port 50052"),
        (mutate(docs, "ConfigMap", "dspark-decode-config", lambda d: d["data"].update(
            DSPARK_PREFILL="dspark-prefill-grpc:50052")), "50052"),
        (mutate(docs, "LeaderWorkerSet", "dspark-prefill", lambda d: lws_leader(d)["env"][1].update(
            value="$(LWS_WORKER_IDX)")), "LWS_WORKER_IDX"),
        (mutate(docs, "LeaderWorkerSet", "dspark-prefill", lambda d: lws_leader(d).update(
            args=["serve-prefill", "--grpc-port", "1"])), "--grpc-port"),
        (mutate(docs, "Deployment", "dspark-decode", lambda d: d["spec"]["template"]["spec"]["containers"][0][
            "readinessProbe"]["httpGet"].update(path="/readyz")), "/ready"),
        (mutate(docs, "NetworkPolicy", "dspark-decode", lambda d: d["spec"]["ingress"][1].pop("from")),
         "open beyond the pair"),
        (mutate(docs, "NetworkPolicy", "dspark-prefill", lambda d: d["spec"]["ingress"][1]["ports"].pop(0)),
         "not opened"),
        (mutate(docs, "Service", "dspark-decode", lambda d: d["spec"]["selector"].update(
            {"app.kubernetes.io/component": "decoder"})), "selects no pod"),
    ]
    for bad, needle in cases:
        problems = check_k8s(bad)
        assert needle in " ".join(problems), (needle, problems)
