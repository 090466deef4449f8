# The deployment guide, §2 创建容器: 在每个节点分别创建容器 (verbatim).

bash start-docker.sh quay.io/ascend/vllm-ascend:v0.20.2rc1 ds_v4_flash_yr
