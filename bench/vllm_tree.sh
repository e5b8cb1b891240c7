# Sourced by the device scripts: the vLLM tree in /tmp/site, unpacked from its three parts in /tmp/vparts
# (the offline vLLM 0.26.0 tree, xz'd and split: part_00 part_01 part_02, one carried per call) once all three are there. A tree from
# fewer parts is a truncated archive that imports nothing (a session's device calls lost their vLLM runs
# to one): it is never unpacked, and a tree without vllm/version.py is removed and unpacked again.
if [ -z "${LANE_TINY:-}${SPEED_TINY:-}${SIGNAL_LANE_TINY:-}" ] && [ ! -f /tmp/site/vllm/version.py ]; then
  if [ -f /tmp/vparts/part_00 ] && [ -f /tmp/vparts/part_01 ] && [ -f /tmp/vparts/part_02 ]; then
    rm -rf /tmp/site && mkdir -p /tmp/site
    cat /tmp/vparts/part_00 /tmp/vparts/part_01 /tmp/vparts/part_02 | xz -dc | tar -x -C /tmp/site \
      && echo "vllm tree unpacked into /tmp/site" || { echo "vllm tree: the parts do not unpack"; rm -rf /tmp/site; }
  else
    echo "vllm tree: not all three parts are in /tmp/vparts ($(ls /tmp/vparts 2>/dev/null | tr '\n' ' ')): not unpacked"
  fi
fi
