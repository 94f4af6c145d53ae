"""Runs inside a sandbox as a command's parent (``gateway_proxy.forward_argv``), with built-in modules only:
``python -I -S -c SOURCE PORT SOCKET COMMAND...``. It listens on 127.0.0.1:PORT in the sandbox's own network
namespace, pipes each connection to the Unix socket SOCKET (the service's proxy of one URL), runs COMMAND and
exits with its status (128 + N when a signal N killed it)."""

import socket
import subprocess
import sys
import threading


def pipe(source, target):
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            target.sendall(data)
    except OSError:
        pass
    finally:
        try:
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def serve(connection, path):
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        connection.close()
        upstream.close()
        return
    back = threading.Thread(target=pipe, args=(upstream, connection), daemon=True)
    back.start()
    pipe(connection, upstream)
    back.join()
    connection.close()
    upstream.close()


def accept(listener, path):
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=serve, args=(connection, path), daemon=True).start()


def main():
    port, path, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    listener = socket.create_server(("127.0.0.1", port))
    threading.Thread(target=accept, args=(listener, path), daemon=True).start()
    try:
        child = subprocess.Popen(argv)
    except OSError as err:
        sys.stderr.write(f"{argv[0]}: {err}\n")
        return 127
    status = child.wait()
    return 128 - status if status < 0 else status


sys.exit(main())
