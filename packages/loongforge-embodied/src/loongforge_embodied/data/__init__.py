"""Data: LeRobotDataset v3 (recorded offline by ``loongforge data prepare``) or synthetic samples."""
