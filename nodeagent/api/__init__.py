"""What operators and machines read and ask of a node: the HTTP API (with the cluster actions and OpenAPI),
`/metrics`, MQTT, the node alert lines and the status page (`ui`).
"""
