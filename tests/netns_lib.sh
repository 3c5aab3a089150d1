# Sourced by the tests that build a network of namespaces (test_chaos.sh,
# test_nat_netns.sh). netns_hub P NET TAG: namespace ${P}hub holds bridge
# br0; namespaces ${P}c, ${P}n1, ${P}n2 and ${P}n3 each have one veth, eth0,
# at NET.1 to NET.4 (/24) with its other end (TAG1$$ to TAG4$$) on the
# bridge. The caller deletes the namespaces (ip netns del) when it is done.
netns_hub() {
  local p=$1 net=$2 tag=$3 i=1 ns
  ip netns add "${p}hub"
  ip -n "${p}hub" link add br0 type bridge
  ip -n "${p}hub" link set br0 up
  for ns in c n1 n2 n3; do
    ip netns add "$p$ns"
    ip link add "$tag$i$$" type veth peer name eth0 netns "$p$ns"
    ip link set "$tag$i$$" netns "${p}hub"
    ip -n "${p}hub" link set "$tag$i$$" master br0 up
    ip -n "$p$ns" addr add "$net.$i/24" dev eth0
    ip -n "$p$ns" link set eth0 up
    ip -n "$p$ns" link set lo up
    i=$((i + 1))
  done
}
