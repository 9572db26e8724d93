"""Sandbox networking beyond loopback (docs/network.md): ``settings`` (uplink, ranges, DNS
upstream, named allowlists), ``policy`` (rules), ``firewall`` (the nftables table),
``links`` (veth pairs over netlink), ``dns`` (the filtering resolver), ``ranges`` (pins of
port ranges, placed without overlaps), ``manager`` (pooling, attach and detach)."""
