# Source me: `. slurm/local/env.sh` points the Slurm client commands at the cluster that
# slurm/local/up.sh started (state folder ${LAUNCHER_SLURM_STATE:-/tmp/launcher-slurm}).
export SLURM_CONF=${LAUNCHER_SLURM_STATE:-/tmp/launcher-slurm}/slurm.conf
