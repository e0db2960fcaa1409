# Prometheus from Debian's packages: the stand-in for prom/prometheus where no container registry can be
# reached. Same contract as the public image for docker-compose.yml: the entry point is prometheus (compose
# passes its flags), `wget` for the health check, /prometheus writable for the data.
ARG DEBIAN_IMAGE=distillq-debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus /etc/prometheus \
    && chown nobody:nogroup /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
