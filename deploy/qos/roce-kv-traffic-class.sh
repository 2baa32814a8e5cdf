#!/usr/bin/env bash
# RoCE equivalent of the InfiniBand QoS: DSCP -> traffic class -> ETS weight on each compute NIC.
# Run once per host (root), per RDMA netdev. Needs mlnx_qos (MLNX_OFED / mstflint) and a switch configured with
# the same DSCP-to-priority map and PFC on the lossless priorities.
#
#   model traffic (NCCL):  DSCP 26 -> priority 3, lossless (PFC), large ETS share  -> --collective-dscp 26 (NCCL_IB_TC=104)
#   KV traffic (DualPath): DSCP 10 -> priority 1, lossless (PFC), small ETS share  -> --kv-dscp 10 (traffic class 40)
#
# The traffic class an application sets is DSCP << 2 (the low two bits are ECN). Both DSCPs are dualpath's defaults
# (QosConfig); README.md beside this file has the whole path.
set -euo pipefail
IFACE=${1:?usage: roce-kv-traffic-class.sh <netdev, e.g. ens1f0np0>}

mlnx_qos -i "$IFACE" --trust dscp
# priority -> traffic class 1:1; ETS bandwidth: TC3 (model) 90%, TC1 (KV) 5%, the rest 5%
mlnx_qos -i "$IFACE" --pfc 0,1,0,1,0,0,0,0 \
  --tsa ets,ets,ets,ets,ets,ets,ets,ets --tcbw 5,5,0,90,0,0,0,0
mlnx_qos -i "$IFACE" --dscp2prio set,26,3
mlnx_qos -i "$IFACE" --dscp2prio set,10,1
echo "$IFACE: model traffic DSCP 26 (dualpath --collective-dscp 26: NCCL_IB_TC=104), KV traffic DSCP 10 (dualpath --kv-dscp 10)"
