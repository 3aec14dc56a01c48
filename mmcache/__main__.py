from mmcache.cli import main

main()
