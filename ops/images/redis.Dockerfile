# Redis 7 from Debian's packages: the stand-in for redis:7 where no container registry can be reached. Same
# contract as the public image for docker-compose.yml: `redis-server` and `redis-cli` on PATH, data in /data.
ARG DEBIAN_IMAGE=distillq-debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data /usr/local/etc/redis \
    && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--dir", "/data"]
