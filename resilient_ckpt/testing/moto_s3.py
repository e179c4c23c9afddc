"""moto's S3 server on loopback, for tests and the bench (the `test` extra).

    with MotoS3() as s3:
        tier = FsspecTier(f"s3://{s3.bucket()}/run", storage_options=s3.options())

`MotoS3` starts `moto.server.ThreadedMotoServer` on 127.0.0.1 on a free port
and stops that server (and only it) on exit. `options(endpoint)` are the
s3fs storage options for it (dummy credentials; `endpoint` to go through a
fault proxy in front of it), `bucket()` creates a fresh bucket.
"""
from __future__ import annotations

import logging
import uuid


class MotoS3:
    def __init__(self):
        self._server = None
        self.endpoint = ""

    def start(self) -> MotoS3:
        from moto.server import ThreadedMotoServer
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def options(self, endpoint: str | None = None) -> dict:
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": endpoint or self.endpoint,
                                  "region_name": "us-east-1"}}

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        import boto3
        name = "b-" + uuid.uuid4().hex[:12]
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=name)
        return name
