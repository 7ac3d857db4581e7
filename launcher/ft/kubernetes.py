"""The replica group of a pod that a Kubernetes JobSet started, from what its environment holds; a pure function.

A JobSet whose replicated job runs one Job per replica group (`replicas: N`) marks each Job, and its pods, with
the Job's index among them, 0 to N-1, in the label and annotation `jobset.sigs.k8s.io/job-index`; but JobSet sets
labels and annotations only, no variable. What a pod's environment holds without help from its manifest is
Kubernetes' own: JOB_COMPLETION_INDEX, the pod's index inside its Job (an Indexed Job, JobSet's default: the
group's node, not the group), and HOSTNAME, which with JobSet's DNS hostnames (on unless
`network.enableDNSHostnames: false`) is `<jobset>-<replicated job>-<job index>-<pod index>`.

So a pod's group is its job index, read where it is found:

- REPLICA_GROUP_ID, where the manifest sets it from the label by the Downward API (settings.py reads it first;
  docs/fault-tolerance.md#kubernetes has the manifest);
- else, in a pod of an Indexed Job (JOB_COMPLETION_INDEX set), the number before the last in HOSTNAME, whose
  last number must be JOB_COMPLETION_INDEX. Where JOBSET_NAME (the name JobSet's own restart agent reads) and
  REPLICATED_JOB_NAME are set, from the labels `jobset.sigs.k8s.io/jobset-name` and `.../replicatedjob-name`,
  HOSTNAME must begin with them: a plain Indexed Job whose name ends in a number is then not taken for a JobSet.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

from launcher.errors import UserError, short

INDEX = "JOB_COMPLETION_INDEX"  # Kubernetes': the pod's index inside its Indexed Job
NAMES = ("JOBSET_NAME", "REPLICATED_JOB_NAME")  # optional, from JobSet's labels by the Downward API
LABEL = "jobset.sigs.k8s.io/job-index"
FIX = (f"set REPLICA_GROUP_ID from the label {LABEL} by the Downward API (docs/fault-tolerance.md#kubernetes), "
       f"or fault_tolerance.group")


def group(env: Mapping[str, str], groups: int) -> Optional[int]:
    """This pod's replica group from a JobSet's environment; None outside a pod of an Indexed Job."""
    pod = env.get(INDEX)
    if pod is None:
        return None
    host = env.get("HOSTNAME", "")
    named = [env.get(name) or "" for name in NAMES]
    prefix = "-".join(re.escape(name) if name else ".+" for name in named)
    found = re.fullmatch(rf"{prefix}-(\d+)-{re.escape(pod.strip())}", host)
    if found is None:
        form = "-".join(name or shown for name, shown in zip(named, ("<jobset>", "<replicated job>")))
        form = f"{form}-<job index>-{pod.strip()}"
        raise UserError(f"fault_tolerance.group: not set, and this pod of an Indexed Job ({INDEX}={short(pod)}) "
                        f"has HOSTNAME={short(host)}, not a JobSet pod's {form}; {FIX}")
    index = int(found.group(1))
    if index >= groups:
        raise UserError(f"fault_tolerance.group: this JobSet pod's job index is {index} (HOSTNAME={short(host)}), "
                        f"not a group index of fault_tolerance.groups={groups}: 0 to {groups - 1}; the replicated "
                        f"job's replicas must be fault_tolerance.groups")
    return index
