"""Reference solution, chapter 09: the events of a server-sent-event stream, from network chunks."""

import json


def my_read_events(chunks):
    buffer = b""  # bytes, not text: a chunk may end inside a multi-byte character
    for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:  # a blank line ends an event; what follows waits for more bytes
            event, buffer = buffer.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ")
            if data == "[DONE]":
                return
            yield json.loads(data)
