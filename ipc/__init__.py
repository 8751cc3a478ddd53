"""Everything that crosses a process boundary: config, message types, codec and sockets.

Business code imports message classes and channel wrappers from here and never touches
zmq or msgpack directly.
"""
