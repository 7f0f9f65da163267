"""What the edge and the cloud share: the wire protocol, boundary codecs, the precision policy, the manifest.

Pure Python + numpy + msgpack + zstandard (no torch): the phone imports this package.

* :mod:`shared.protocol` - the message set and frame encoding (``messages``, ``wire``, ``tensors``, ``errors``)
* :mod:`shared.codecs` - boundary hidden-state codecs by name (``codecs_plain``, ``codecs_outlier``)
* :mod:`shared.compression` - bounded zstd
* :mod:`shared.chunking` - Prefill messages within the negotiated limits
* :mod:`shared.session_state` - the session state machine both ends enforce
* :mod:`shared.precision` - the per-request precision policy (``plan`` holds the wire struct)
* :mod:`shared.manifest` - the bundle manifest

The protocol is specified in docs/protocol.md; codec quality is measured in docs/quality.md.
"""
