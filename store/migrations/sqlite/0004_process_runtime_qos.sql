-- What the agent reads from a process's cgroup besides the container id and
-- the pod: which runtime runs the container, and the pod's QoS class (which
-- decides who the kubelet evicts first). Empty where unknown.
ALTER TABLE processes ADD COLUMN container_runtime TEXT NOT NULL DEFAULT '';
ALTER TABLE processes ADD COLUMN pod_qos_class TEXT NOT NULL DEFAULT '';
