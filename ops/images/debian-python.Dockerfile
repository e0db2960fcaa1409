# Python 3.11 on the Debian base ops/compose-offline.sh makes from Debian's packages: the stand-in for
# python:3.11-slim where no container registry can be reached. `python` and `pip` are a venv's, first on PATH,
# as they are in the public image.
ARG DEBIAN_IMAGE=distillq-debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive PATH=/opt/python/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/python \
    && python -m pip --version
CMD ["python3"]
